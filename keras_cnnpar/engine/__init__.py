"""One training run once its strategy is known: prepare, fit, finalize and log (:mod:`.fitting`), with the user's
callbacks run against the user's model (:mod:`.user_callbacks`)."""
