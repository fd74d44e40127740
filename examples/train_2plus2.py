"""Train the original 2+2 CNN with sync data parallelism on 2 devices, then export it.

Run: python examples/train_2plus2.py
"""

import keras_cnnpar as cnnpar

cnnpar.devices.configure(2)  # before any model or tensor exists

model = cnnpar.models.cnn("2+2")
train, val = cnnpar.data.split(cnnpar.data.load(), validation_fraction=0.2, seed=0)
history = model.fit(train.x, train.y, epochs=3, batch_size=64, validation_data=(val.x, val.y),
                    strategy=cnnpar.DataParallel(devices=2))
print("validation accuracy per epoch:", [round(a, 4) for a in history.history["val_accuracy"]])
model.export("models/cnn2d_2layer_fullconnected_2layer/1")
