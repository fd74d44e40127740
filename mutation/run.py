"""Mutation testing of one module with the tests that cover it: ``python mutation/run.py MODULE``.

mutmut (3.x) makes every small change it can to the module (an operator, a constant, a condition, a removed call or
argument), runs the module's tests against each (only those that reach the mutated function) and counts the
mutants no test notices. This script copies the package and the tests into ``mutation/work/<module>/`` (ignored
by git, made afresh each run; mutmut keeps its ``mutants/`` there for ``mutmut show`` and ``browse``), writes the
mutmut and pytest configuration of that one module there, runs mutmut, and writes
``mutation/results/<module>.txt``: the counts, the wall time and each survivor's diff. How to read it, and the
per-module table: docs/mutation.md.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Each module that is measured, and the pytest arguments of the tests that cover it: the test files or tests
#: that promise its behaviour, and its own doctests (the module's path, with ``--doctest-modules``).
SELECTION = {
    "keras_cnnpar/cluster/traffic.py": [
        "tests/test_properties.py", "tests/test_scaling.py::test_a_link_is_read_as_tc_writes_it_and_anything_else_is_"
        "refused_saying_what_was_expected", "keras_cnnpar/cluster/traffic.py"],
    "keras_cnnpar/strategies/arguments.py": [
        # Not tests/test_compression.py's test of the warning's line: mutmut's trampoline adds a frame to the stack.
        "tests/test_properties.py", "tests/test_compression.py::test_all_reduce_dtype_is_the_former_spelling_of_"
        "bfloat16_compression", "keras_cnnpar/strategies/arguments.py"],
    "keras_cnnpar/cluster/spec.py": [
        "tests/test_properties.py", "tests/test_environments.py", "keras_cnnpar/cluster/spec.py"],
    "keras_cnnpar/results/runs.py": [
        # tests/test_logging.py's tests of runs.csv that train no model: a trained run reaches append_run once.
        "tests/test_properties.py", *(f"tests/test_logging.py::test_{name}" for name in (
            "the_speedup_baseline_is_the_latest_single_run_of_the_same_model_and_batch",
            "a_hand_edited_runs_csv_header_is_refused_naming_the_difference_and_left_alone",
            "an_older_runs_csv_with_a_row_it_cannot_map_is_refused_not_dropped",
            "every_older_runs_csv_is_migrated_keeping_every_row_and_a_copy_of_the_file",
            "a_runs_images_per_second_leaves_out_the_first_and_the_profiled_epoch_while_another_remains",
            "a_runs_csv_that_a_spreadsheet_saved_with_a_byte_order_mark_keeps_its_rows",
            "a_runs_row_holds_its_last_epochs_figures_its_median_throughput_and_its_speedup_against_single",
            "throughput_speedup_and_efficiency_are_rounded_and_empty_where_unknown",
            "a_runs_own_files_are_in_its_folder_and_without_an_id_they_are_the_configurations",
            "a_row_appended_after_a_line_cut_short_starts_a_line_of_its_own_and_the_cut_line_is_named",
            "a_runs_csv_spoilt_during_the_run_is_left_as_it_is_and_the_row_warned_lost_or_refused_with_strict",
            "an_older_runs_csv_met_at_a_runs_end_is_replaced_at_once_by_its_migrated_rows_and_the_run",
            "a_runs_csv_header_no_version_wrote_is_refused_naming_how_it_differs_from_the_nearest",
            "a_refused_header_is_quoted_whole_up_to_100_characters_then_cut",
            "read_runs_takes_an_older_header_leaves_out_a_line_cut_short_naming_it_and_refuses_bytes_not_utf8",
            "the_results_log_gets_whole_lines_appended_in_a_folder_made_for_it",
            "a_results_file_is_made_under_the_umask_as_a_file_not_a_program",
            "a_results_file_that_is_a_symbolic_link_is_refused_naming_its_target_and_nothing_is_written",
            "a_results_file_that_is_not_a_regular_file_or_not_writable_is_refused_naming_what_it_is",
            "csv_text_writes_only_the_columns_of_its_header",
            "an_older_runs_csv_is_migrated_whatever_line_breaks_of_unicode_its_values_hold_and_after_a_byte_order_mark")),
        "keras_cnnpar/results/runs.py"],
    "keras_cnnpar/cluster/environments.py": [
        # Not the slow test of `cnnpar launch` in a pod: a launcher process per mutant; -m selects the others.
        "tests/test_properties.py", "tests/test_environments.py", "-m", "not slow",
        "keras_cnnpar/cluster/environments.py"],
    "keras_cnnpar/runtime/atomic.py": [
        *(f"tests/test_logging.py::test_{name}" for name in (
            "a_file_written_at_once_replaces_the_old_whole_under_the_umasks_mode_leaving_no_temporary",
            "a_library_that_writes_a_new_file_in_the_temporarys_place_still_gets_the_umasks_mode",
            "a_write_that_fails_leaves_the_old_file_and_no_temporary_whether_it_fails_writing_or_renaming",
            "files_written_together_all_change_or_none_and_no_temporary_is_left",
            "a_made_folder_that_a_failed_block_leaves_empty_goes_again_and_only_the_folders_it_made",
            "a_discarded_temporary_is_emptied_unless_another_name_holds_it",
            "the_room_check_refuses_one_byte_more_than_is_free_naming_both",
            "the_umask_is_read_where_linux_shows_it_else_set_and_restored",
            "a_probe_names_the_folder_it_could_not_create_in_a_file_on_the_way_or_a_link_to_nothing")),
        "keras_cnnpar/runtime/atomic.py"],
    "keras_cnnpar/strategies/registry.py": [
        # Not the test that trains a user's strategy (a fit per mutant), nor the slow ones (fresh processes).
        *(f"tests/test_user_strategy.py::test_{name}" for name in (
            "a_registered_user_strategy_is_a_cli_choice_and_a_plan_configuration",
            "a_user_strategy_cannot_take_a_name_of_the_package",
            "the_registry_reads_each_strategys_class_facts_and_options_from_the_source",
            "each_strategy_says_why_a_device_count_does_not_suit_it",
            "a_fact_is_the_nearest_classs_assignment_alone_or_in_a_tuple_and_a_missing_one_is_named",
            "a_plugin_that_fails_to_import_is_left_out_with_a_one_line_warning_and_loaded_once")),
        "tests/test_strategies.py::test_every_registered_alias_names_a_strategy_class_that_declares_it",
        "tests/test_strategies.py::test_unknown_alias_lists_the_valid_names", "keras_cnnpar/strategies/registry.py"],
    "keras_cnnpar/plan/experiments.py": [
        # The tests of the plan, the sweep's record and the report, and of a configuration's process run as a short
        # Python; not those that train a configuration (a training process per mutant).
        *(f"tests/test_experiments.py::test_{name}" for name in (
            "the_plan_runs_each_strategy_on_the_device_counts_it_declares",
            "a_configuration_trains_in_a_process_given_its_options_and_returns_its_code_and_last_five_lines",
            "a_configuration_past_its_timeout_returns_minus_one_and_its_process_group_ends_with_it",
            "a_sweeps_record_has_its_header_once_and_a_line_per_configuration_its_output_on_that_line",
            "a_configuration_is_complete_only_when_runs_csv_has_its_model_strategy_devices_batch_and_epochs",
            "report_without_runs_says_so",
            "the_reports_figures_show_each_models_accuracy_by_epoch_and_each_configurations_figures_as_bars",
            "a_report_holds_each_configurations_latest_run_rounded_flagged_and_where_its_figures_come_from",
            "a_report_of_a_runs_csv_that_cannot_be_read_names_it_and_writes_nothing",
            "a_run_without_a_throughput_has_no_speedup_beside_a_baseline_and_two_producers_are_warned_of",
            "report_flags_a_multi_device_run_below_80_percent_efficiency_naming_its_largest_share",
            "report_flags_a_failed_parity_check")),
        "keras_cnnpar/plan/experiments.py"],
    "keras_cnnpar/results/checkpoints.py": [
        # The tests of RunCheckpoint itself, on the small CNN; not the preemption's (a cluster of processes).
        *(f"tests/test_multi_worker.py::test_{name}" for name in (
            "an_existing_checkpoint_needs_resume", "resuming_with_another_configuration_refuses_and_names_each_"
            "difference", "an_elastic_resume_accepts_another_worker_count_says_so_and_still_refuses_other_data",
            "a_checkpoint_records_its_configuration_sorted_and_a_failed_save_keeps_the_previous_epoch",
            "a_preemption_checkpoint_alone_is_a_checkpoint_that_needs_resume",
            "a_resume_beside_a_checkpoint_of_the_same_settings_names_the_folders_name_as_the_difference",
            "removing_a_runs_checkpoint_removes_its_parent_only_when_no_other_run_is_left")),
        *(f"tests/test_refusals.py::test_{name}" for name in (
            "resume_of_another_configuration_names_the_checkpoint_found_and_the_difference",
            "a_resume_with_nothing_to_resume_says_so_in_one_warning_and_starts_anew")),
        "tests/test_logging.py::test_tensorflows_warning_that_its_own_checkpoint_saver_retraced_is_not_shown",
        "keras_cnnpar/results/checkpoints.py"],
    "keras_cnnpar/strategies/memory.py": ["tests/test_memory.py", "keras_cnnpar/strategies/memory.py"],
}

#: pytest as the suite runs it, less what a mutant run must not do: no xdist workers (mutmut forks one process per
#: mutant), no cache, no slowest-tests list.
PYTEST = """
[tool.pytest.ini_options]
timeout = 600
filterwarnings = ["ignore::DeprecationWarning"]
markers = ["slow: accuracy floors and tests of processes, clusters and hosts"]
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", choices=sorted(SELECTION), help="the module to mutate")
    parser.add_argument("--max-children", type=int, default=1, help="mutants run at once (default 1)")
    args = parser.parse_args(argv)
    module = args.module
    work = ROOT / "mutation" / "work" / Path(module).stem
    _prepare(work, module)
    started = time.perf_counter()
    # CNNPAR_MUTATION: the property tests do not shrink a failing example (tests/test_properties.py's PROPERTY).
    subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)],
                   cwd=work, check=True, env={**os.environ, "CNNPAR_MUTATION": "1"})
    seconds = time.perf_counter() - started
    report = _report(work, module, seconds)
    out = ROOT / "mutation" / "results" / (Path(module).stem + ".txt")
    out.parent.mkdir(exist_ok=True)
    out.write_text(report)
    print(report.split("\n\n")[0])
    print(f"written: {out.relative_to(ROOT)}")


def _prepare(work, module):
    """The package, the tests and the configuration of ``module``'s run in ``work``, afresh: mutmut's own cache
    would keep a previous run's verdicts, and the run's wall time would not be the module's."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("keras_cnnpar", "tests"):
        shutil.copytree(ROOT / folder, work / folder, ignore=ignore)
    shutil.copy2(ROOT / "conftest.py", work / "conftest.py")
    selection = SELECTION[module]
    mutmut = {"source_paths": ["keras_cnnpar"], "only_mutate": [module], "also_copy": ["conftest.py"],
              "pytest_add_cli_args": ["-p", "no:cacheprovider", "-q", "--doctest-modules"],
              "pytest_add_cli_args_test_selection": selection}
    lines = ["[tool.mutmut]"] + [f"{key} = {json.dumps(value)}" for key, value in mutmut.items()]
    (work / "pyproject.toml").write_text("\n".join(lines) + "\n" + PYTEST)


def _report(work, module, seconds):
    """The counts, the wall time and each survivor's diff, as text."""
    stats = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text()) if _export(work) else {}
    listed = subprocess.run([sys.executable, "-m", "mutmut", "results"], cwd=work, capture_output=True,
                            text=True).stdout
    survivors = [line.split(":")[0].strip() for line in listed.splitlines() if line.strip().endswith(": survived")]
    total = stats.get("total", 0)
    killed = stats.get("killed", 0)
    head = (f"module: {module}\ntests: {' '.join(SELECTION[module])}\nmutants: {total}\nkilled: {killed}"
            f" ({100 * killed / max(total, 1):.1f}%)\nsurvived: {stats.get('survived', 0)}\n"
            f"timeout: {stats.get('timeout', 0)}\nno tests: {stats.get('no_tests', 0)}\n"
            f"other: {total - killed - stats.get('survived', 0) - stats.get('timeout', 0) - stats.get('no_tests', 0)}\n"
            f"wall time: {seconds:.0f} s (mutmut run, after the copy)")
    diffs = [subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, capture_output=True,
                            text=True).stdout for name in survivors]
    return "\n\n".join([head, *(re.sub(r"\n{3,}", "\n\n", diff).strip() for diff in diffs)]) + "\n"


def _export(work):
    return subprocess.run([sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=work,
                          capture_output=True).returncode == 0


if __name__ == "__main__":
    main()
