"""Mutation check: each mutant is a deliberate bug; the test suite must fail on every one of them.

    python tests/mutants.py                 # every mutant, each against its own test files
    python tests/mutants.py --list          # the mutants and their tests
    python tests/mutants.py nibble-order    # only the mutants named
    python tests/mutants.py --all-tests     # each mutant against the whole default suite (slow)
    python tests/mutants.py -j 4            # 4 mutants at a time (default: one per core this process may use)

A mutant is a list of edits ``(where, exact old text, new text)``; every occurrence of the old text there is
replaced. ``where`` is ``def NAME`` (or ``def Class.method``): the one definition of that name in the package,
found wherever it lives, so a mutant follows its code from module to module; or a file path for text outside
any function. For each mutant the repository (without .git and caches) is copied into a temporary
folder, the edits applied there, and pytest run in the copy with ``PYTHONPATH`` pointing at it, so the
checkout itself is never touched. Outcomes:

- ``killed``: pytest reported a failure (exit 1), as it must;
- ``killed (error)``: pytest could not even collect or run (exit 2..5), e.g. the bug broke an import;
- ``SURVIVED``: every test passed with the bug in place: a test is missing or too weak;
- ``could not apply``: an old text is no longer in its file (the code was rewritten): update the mutant;
- ``survived (open)``: a mutant marked ``open_question``: no input is known that tells it from the code (its
  note says what was searched); reported, not counted as a failure.

Mutants run ``--jobs`` at a time, each in its own copy; a line ``[n/N]`` reports each as it finishes, and the
summary at the end lists them in the order above.

Every pytest run gets a fresh hypothesis example database and a fixed hypothesis seed, and the mutants' tests
first run on an unmutated copy (the baseline): a mutant counts as killed only against tests that pass without it.

Exit status: 0 when no mutant survived and all applied, 1 otherwise, 2 when the baseline fails.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONVERT_TESTS = ["tests/onnx/test_onnx_convert.py", "tests/cli/test_cmd_inspect.py", "tests/convert/test_convert.py",
                 "tests/cli/test_cmd_convert.py"]
CHECKPOINT_TESTS = ["tests/checkpoint/test_checkpoint_shard_writer.py", "tests/checkpoint/test_checkpoint_convert.py",
                    "tests/checkpoint/test_checkpoint_cli.py", "tests/checkpoint/test_checkpoint_configs.py"]
CKPT_CALIB_TESTS = ["tests/checkpoint/test_checkpoint_calib_data.py"]
CKPT_CALIBRATE_TESTS = ["tests/checkpoint/test_checkpoint_calibrate.py"]
CKPT_RUNNER_TESTS = ["tests/checkpoint/test_checkpoint_runner_bugs.py"]
CKPT_HOSTILE_TESTS = ["tests/campaigns/test_checkpoint_calib_hostile.py"]
LOOP_TESTS = ["tests/checkpoint/test_checkpoint_layer_loop.py"]
DIFF_TESTS = ["tests/checkpoint/test_checkpoint_diff.py"]
DIFF_ORACLE_TESTS = ["tests/checkpoint/test_checkpoint_diff_oracle.py"]
DIFF_REPORT_TESTS = ["tests/checkpoint/test_checkpoint_diff_report.py"]
DIFF_CHECKS_TESTS = ["tests/checkpoint/test_checkpoint_diff_checks.py"]
ORT_CUDA_TESTS = ["tests/onnx/test_ort_placement.py"]
GPU_CHECK_TESTS = ["tests/project/test_gpu_check.py"]
VALIDATE_TRUST_TESTS = ["tests/checkpoint/test_validate_trust.py"]
HOSTILE_RULES_TESTS = ["tests/checkpoint/test_exclusion_patterns.py", "tests/campaigns/test_validate_hostile.py"]
CALIB_TESTS = ["tests/calib/test_calib_scales.py", "tests/calib/test_calib_stats.py", "tests/calib/test_calib_calibrators.py",
               "tests/onnx/test_calib_runner.py", "tests/calib/test_calib_perf.py", "tests/cli/test_calib_command.py"]


USER_PATH_TESTS = ["tests/campaigns/test_flags_usage_and_quiet.py"]
ROUND5_TESTS = ["tests/campaigns/test_quiet_progress_and_startup.py"]
DOORS_TESTS = ["tests/cli/test_cmd_doors.py"]
FORMS_USED_TESTS = ["tests/project/test_records_spelled_once.py"]
INPUT_TESTS = ["tests/campaigns/test_wrong_inputs_redirect.py"]
OVERWRITE_TESTS = ["tests/base/test_output_overwrite.py"]
KIMI_K3_TESTS = ["tests/checkpoint/test_checkpoint_kimi_k3.py"]
REMOTE_CODE_TESTS = ["tests/checkpoint/test_checkpoint_remote_code.py"]
SWAP_TESTS = ["tests/base/test_overwrite_swap.py"]
HUB_TESTS = ["tests/checkpoint/test_hub.py"]
BOUNDS_TESTS = ["tests/checkpoint/test_patterns_bounds.py"]
CALIB_BOUNDS_TESTS = ["tests/checkpoint/test_calib_data_bounds.py"]


@dataclass
class Mutant:
    name: str
    what: str
    edits: list[tuple[str, str, str]]
    tests: list[str] = field(default_factory=lambda: list(CONVERT_TESTS))
    note: str = ""  # what is known when it survives
    #: no input is known that tells this mutant from the code (possibly an equivalent mutant; the note says
    #: what was tried): reported as "survived (open)" and not counted as a failure; a test that kills it is
    #: welcome, and then it is reported as killed like any other
    open_question: bool = False


MUTANTS = [
    # -- inspect of a Hub ID that is not cached: headers only -------------------------------------------------
    Mutant("hub-inspect-downloads-shards", "inspect of an uncached Hub ID downloads every shard", [
        ("fp4pass/commands/inspect.py", "    remote = uncached_hub_id(args.model)\n", "    remote = None\n"),
    ], ["tests/checkpoint/test_hub_headers.py"]),
    Mutant("hub-partial-snapshot-as-local", "a cached snapshot that lacks shards taken for a local copy", [
        ("def uncached_hub_id", "    return None if folder is not None and not missing else parsed",
         "    return None if folder is not None else parsed"),
    ], ["tests/checkpoint/test_hub_headers.py"]),
    Mutant("hub-headers-nvfp4-as-mxfp4", "an NVFP4 repository's E4M3 block scales not told from MXFP4", [
        ("def inspect_hub_headers", '    if any(block_precision(e.dtype) == "nvfp4"',
         '    if False and any(block_precision(e.dtype) == "nvfp4"'),
    ], ["tests/checkpoint/test_hub_headers.py"]),
    Mutant("hub-headers-engine-exit", "inspect ORG/NAME --engine E exits 0 where E does not load it", [
        ("def inspect_from_headers", '    return 1 if engine and not info["engines"][engine]["loads"] else 0',
         "    return 0"),
    ], ["tests/checkpoint/test_hub_headers.py"]),
    # -- forms, families and Kimi-K3 ------------------------------------------------------------------------
    Mutant("deepseek-v4-weight-only-fp8-form-written", "DeepSeek-V4's W4A4-only FP8 config form written without "
           "input scales", [
        ("def _refuse_weight_only_fp8_form", '    if with_input or output_style(fmt, config) != "deepseek-v4-fp8":',
         "    if True:"),
    ], ["tests/checkpoint/test_checkpoint_engines.py"]),
    Mutant("deepseek-v4-refusal-ignores-input-scales", "DeepSeek-V4's FP8 config form refused even with input scales",
           [("def _refuse_weight_only_fp8_form", '    if with_input or output_style(fmt, config) != "deepseek-v4-fp8":',
             '    if output_style(fmt, config) != "deepseek-v4-fp8":')], ["tests/checkpoint/test_checkpoint_engines.py"]),
    Mutant("kimi-sglang-aliases-dropped", "the exclusion list without SGLang's run-time spelling of each entry", [
        ("def exclude_list",
         "    return list(out) + _sglang_aliases(list(out), kept_modules, converted_modules, architecture, style)",
         "    return list(out)"),
    ], KIMI_K3_TESTS),
    Mutant("kimi-sglang-alias-unchecked", "an alias written even where it is a substring of a converted module", [
        ("def _sglang_aliases.safe", "        return alias not in have and not any(stem in t for t in targets)",
         "        return alias not in have"),
    ], KIMI_K3_TESTS + ["tests/checkpoint/test_checkpoint_engines.py"]),
    Mutant("mxfp4-block-read-as-nvfp4", "an E8M0 (U8) block scale beside weight_packed taken for NVFP4 by its name", [
        ("def find_modules", "        if (fp8_weight or mxfp4_block) and mod.global_ is None:",
         "        if fp8_weight and mod.global_ is None:"),
    ], KIMI_K3_TESTS),
    Mutant("nested-quantization-config-ignored", "only config.json's top level is read for the quantization", [
        ("def quantization_config_place", "        nested = config.get(key)\n        if isinstance(nested, dict) and "
         "isinstance(nested.get(QUANT_KEY), dict):", "        nested = None\n        if isinstance(nested, dict) and "
         "isinstance(nested.get(QUANT_KEY), dict):"),
    ], KIMI_K3_TESTS),
    Mutant("text-config-keeps-mxfp4", "the output's text_config still describes the MXFP4 source", [
        ("def with_quantization_config", "            out[key] = {**nested, QUANT_KEY: description}", "            pass"),
    ], KIMI_K3_TESTS),
    Mutant("mixed-precision-read-as-nvfp4", "MIXED_PRECISION's quantized_layers ignored: unlisted Linears taken "
           "as NVFP4", [
        ("def Exclusions.__init__", "                       if quantized_layers is not None and "
         "record.mixed_precision else None)", "                       if False else None)"),
    ], KIMI_K3_TESTS),
    Mutant("ct-targets-ignored", "compressed-tensors config groups' targets ignored (every Linear targeted)", [
        ("def Exclusions.__init__", "if targets is not None and form == \"compressed-tensors\" and "
         "record.reads_targets else None)", "if False else None)"),
    ], KIMI_K3_TESTS),
    Mutant("ct-moe-matched-by-prefix", "a routed-experts layer matched by its own name, not vLLM's "
           "routed_experts.0.<gate>", [
        ("def Exclusions._targeted",
         '            return any(self._targets.matches(self._vllm_name(f"{module}'
         '.routed_experts.0.{gate}"))', '            return any(self._targets.matches(self._vllm_name(f"{module}.0.'
         '{gate}"))'),
    ], KIMI_K3_TESTS),
    Mutant("sglang-names-not-renamed", "SGLang's exclusions judged under the checkpoint's names", [
        ("def Exclusions.__init__", "        self._rename = record.module_name(architecture, "
         "record.lookup_names) if record.lookup_names else None", "        self._rename = None"),
    ], KIMI_K3_TESTS),
    Mutant("examples-cli-not-runnable", "python -m fp4pass.examples.checkpoints writes what calibrate refuses", [
        ("def _build", "                         runnable=not args.names_only)",
         "                         runnable=False)"),
    ], ["tests/checkpoint/test_examples_checkpoints.py"]),
    Mutant("remote-code-without-the-flag", "a folder's own modeling code run without --trust-remote-code", [
        ("def resolve_architecture", "    if trust_remote_code and auto_map:", "    if auto_map:"),
    ], REMOTE_CODE_TESTS),
    Mutant("remote-model-built-without-its-code", "the folder's config class used, but transformers' model", [
        ("def build_skeleton",
         '    remote = {"trust_remote_code": True} if _is_remote(cfg) else {}', "    remote = {}"),
    ], REMOTE_CODE_TESTS),
    # -- calibration inputs bounded: the tokenizer's input, data links, the process's memory limits --------------
    Mutant("tokenizer-input-unbounded", "a row is tokenized whole, whatever the vocabulary lets the cut leave", [
        ("def _tokenize", "        ids = _encode(tokenizer, text, None if wanted is None else wanted - count)",
         "        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)"),
    ], CALIB_BOUNDS_TESTS),
    Mutant("tokenizer-piece-restart-lost", "the next piece starts after the whole piece, not the last kept token", [
        ("def _encode", "        pos += encoded.offsets[keep - 1][1]\n", "        pos += len(piece)\n"),
    ], CALIB_BOUNDS_TESTS),
    Mutant("data-folder-link-out-read", "a --data folder's symlink to a file outside it is read", [
        ("def load_batches", "        _refuse_links_out(path, files)\n", ""),
    ], CALIB_BOUNDS_TESTS),
    Mutant("memory-check-ignores-limits", "calibration's memory check reads only the machine's MemAvailable", [
        ("def available_bytes", "    limits = [_machine_bytes(), rlimit_headroom(), cgroup_headroom()]", "    limits = [_machine_bytes()]"),
    ], CALIB_BOUNDS_TESTS),
    Mutant("cgroup-loosest-level", "the cgroup level with the most room decides", [
        ("def cgroup_headroom", "    return min(found) if found else None", "    return max(found) if found else None"),
    ], CALIB_BOUNDS_TESTS),
    Mutant("cgroup-usage-ignored", "the cgroup's limit is taken as free, its usage not subtracted", [
        ("def cgroup_headroom", "            found.append(max(limit_value - used, 0))", "            found.append(limit_value)"),
    ], CALIB_BOUNDS_TESTS),
    Mutant("rlimit-usage-ignored", "RLIMIT_AS is taken as free, the address space in use not subtracted", [
        ("def rlimit_headroom", "    return max(soft - used, 0)", "    return soft"),
    ], CALIB_BOUNDS_TESTS),
    Mutant("global-scale-shape-as-pair-mismatch", "a weight_scale_2 of two numbers is also called a w1/w3 mismatch", [
        ("def check_pairs", "a.size != 1 or b.size != 1 or np.array_equal(a, b)",
         "not a.size or not b.size or np.array_equal(a, b)"),
    ], CALIB_BOUNDS_TESTS),
    # -- exclusion lists bounded in time and memory; configs within 16 MiB ----------------------------------------
    Mutant("glob-rest-unbounded", "globs without a literal head or tail are tried with no budget", [
        ("def GlobIndex._match", "            budget.check(glob.pattern, name, every=1)\n            if glob.match(name, budget):",
         "            if glob.match(name):"),
    ], BOUNDS_TESTS),
    Mutant("glob-scan-unbounded", "one glob's scan of a long name runs with no budget", [
        ("def _Segment.find", "            if budget is not None:\n                budget.check(entry, name)\n            if self.at(",
         "            if self.at("),
    ], BOUNDS_TESTS),
    Mutant("glob-size-uncapped", "a glob of any length is tokenized (memory per character)", [
        ("def GlobIndex.__init__", "            if special is not None and len(p) > MAX_GLOB_CHARS:", "            if False:"),
    ], BOUNDS_TESTS),
    Mutant("substring-rule-unbounded", "vLLM's substring rule on a long name runs with no budget", [
        ("def SubstringIndex.found_in", "                    budget.check(f\"(an entry of {length} characters)\", name)\n", ""),
    ], BOUNDS_TESTS),
    Mutant("ancestor-rule-unbounded", "SGLang's ancestor rule on a name of many components runs with no budget", [
        ("def dotted_runs", "            if budget is not None:\n                budget.check(f\"(an entry of {count} dots)\", name)\n", ""),
    ], BOUNDS_TESTS),
    Mutant("substring-index-end-off-by-one", "the indexed substring rule misses an entry at the name's end", [
        ("def SubstringIndex.found_in", "                for i in range(n - length + 1):", "                for i in range(n - length):"),
    ], BOUNDS_TESTS),
    Mutant("prefix-index-whole-name-missed", "a prefix glob as long as the name is never tried", [
        ("def GlobIndex._match", "        for length in self.prefix_lengths:\n            if length > n:",
         "        for length in self.prefix_lengths:\n            if length >= n:"),
    ], BOUNDS_TESTS),
    Mutant("regex-expansion-uncapped", "a regex whose counted repeats multiply out is compiled", [
        ("def RegexList.__init__", "            if nodes > MAX_REGEX_NODES:", "            if False:"),
    ], BOUNDS_TESTS),
    Mutant("regex-compile-unbudgeted", "a list's regexes are compiled however long it takes", [
        ("def RegexList.__init__", "            if self.spent > REGEX_BUDGET_SECONDS:\n                raise BadPattern(f\"{what}: compiling",
         "            if False:\n                raise BadPattern(f\"{what}: compiling"),
    ], BOUNDS_TESTS),
    Mutant("config-limit-of-the-index", "config.json is read up to the index's 64 MiB, not 16 MiB", [
        ("def read_json_file", "def read_json_file(path: Path, what: str, limit: int = CONFIG_LIMIT)",
         "def read_json_file(path: Path, what: str, limit: int = JSON_LIMIT)"),
    ], BOUNDS_TESTS),
    Mutant("match-budget-fixed", "the matchers' budget does not grow with the names: big models' real lists fail", [
        ("def Budget.__enter__", "            self.seconds += NAME_ALLOWANCE_SECONDS\n", ""),
    ], BOUNDS_TESTS),
    # -- Hub caches by huggingface_hub's rules; outputs never onto an input's blobs -------------------------------
    Mutant("hub-cache-rules-unchecked", "huggingface_hub reads refs/main whatever it is (a path, a FIFO)", [
        ("fp4pass/safetensors/hub.py", "    cached_snapshot(repo_id, revision, cache_dir)  # the cache's", "    pass  # the cache's"),
    ], HUB_TESTS),
    Mutant("hub-ref-any-text", "a ref is taken for a commit whatever it holds", [
        ("def cached_snapshot", "        if not _COMMIT.fullmatch(text.strip()):", "        if False:"),
    ], HUB_TESTS),
    Mutant("hub-ref-unbounded", "a ref file is read whatever its size", [
        ("def cached_snapshot", "read_regular_file(ref, REF_MAX_BYTES, HubError)", "read_regular_file(ref, 1 << 40, HubError)"),
    ], HUB_TESTS),
    Mutant("hub-snapshot-anywhere", "a snapshot folder that leads out of the cache is read", [
        ("def cached_snapshot", "    if not os.path.isdir(snapshot) or not _within(snapshot, repo / \"snapshots\"):",
         "    if not os.path.isdir(snapshot):"),
    ], HUB_TESTS),
    Mutant("hub-index-opened-before-link-rule", "an index linked out of the snapshot is opened and parsed", [
        ("def missing_files", "        if not _readable_member(folder, index.name):\n            return missing\n", ""),
    ], HUB_TESTS),
    Mutant("hub-cache-at-hf-home", "the Hub cache is looked up under HF_HOME instead of HF_HOME/hub", [
        ("def _cache_dir", 'os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")',
         'os.path.expanduser(os.environ["HF_HOME"])'),
    ], HUB_TESTS),
    Mutant("hub-gated-as-missing", "a gated repository is reported as a missing one", [
        ("def _download", "    except GatedRepoError:\n", "    except ImportError:\n"),
    ], HUB_TESTS),
    Mutant("outputs-onto-input-blobs", "an output into the folder an input's links lead to (Hub blobs) is taken", [
        ("def check_outputs", "            for place in input_places(given)[1:]:\n", "            for place in []:\n"),
    ], HUB_TESTS),
    # -- --overwrite: the marker's file list, the inputs rule, the two-rename swap and its recovery ---------------
    Mutant("overwrite-removes-user-files", "a folder fp4pass wrote is replaced with the user's files in it", [
        ("def _replaceable", "    foreign = first_foreign_file(target, listed)\n", "    foreign = None\n"),
    ], SWAP_TESTS),
    Mutant("overwrite-sizes-not-compared", "a file fp4pass listed but the user rewrote is taken for fp4pass's", [
        ("def first_foreign_file.walk", "listed.get(rel) != st.st_size", "rel not in listed"),
    ], SWAP_TESTS),
    Mutant("overwrite-inputs-inside-taken", "an input of the run inside the folder replaced is removed with it", [
        ("def check_output_folder", "    if inputs:\n        refuse_inputs(target, path, inputs)\n", ""),
    ], SWAP_TESTS),
    Mutant("overwrite-blobs-not-followed", "the folder an input's links lead into (Hub blobs) may be replaced", [
        ("def refuse_inputs", "        for place in input_places(given):\n", "        for place in [os.fspath(given)]:\n"),
    ], SWAP_TESTS),
    Mutant("overwrite-last-check-reads-new", "the last check before the swap reads the new folder, not the old", [
        ("def atomic_folder", "replacing = replacing and _replaceable(target, path, overwrite)",
         "replacing = replacing and _replaceable(tmp, path, overwrite)"),
    ], SWAP_TESTS),
    Mutant("overwrite-marker-unbounded", "the output marker is read whatever its size", [
        ("def read_small_json", "        while size <= limit:", "        while True:"),
        ("def read_small_json", "        return None if size > limit else strict_json(", "        return None if False else strict_json("),
        ("def read_small_json", "min(1 << 20, limit + 1 - size)", "1 << 20"),
    ], SWAP_TESTS),
    Mutant("overwrite-marker-limit-inclusive", "a marker of exactly the bound is refused (>= for >)", [
        ("def read_small_json", "        return None if size > limit else strict_json(",
         "        return None if size >= limit else strict_json("),
    ], SWAP_TESTS),
    Mutant("overwrite-marker-any-depth", "the output marker is parsed however deep it nests", [
        ("def _read_output_marker", "OUTPUT_MARKER_MAX, _OUTPUT_MARKER_DEPTH)", "OUTPUT_MARKER_MAX, 10**9)"),
    ], SWAP_TESTS),
    Mutant("overwrite-replaced-folder-rolled-back", "a run failing after the swap removes the new folder too", [
        ("def atomic_folder", "        if replacing:\n            swap(staging, tmp, target)\n",
         "        if replacing:\n            if outputs._session is not None:\n"
         "                outputs._session.record(target, RESULT, identity)\n            swap(staging, tmp, target)\n"),
    ], SWAP_TESTS),
    Mutant("overwrite-by-default", "atomic_folder replaces an fp4pass folder without being asked", [
        ("def atomic_folder", "inputs: tuple = (), overwrite: bool = False) -> Iterator[Path]:",
         "inputs: tuple = (), overwrite: bool = True) -> Iterator[Path]:"),
    ], SWAP_TESTS),
    Mutant("checkpoint-api-overwrites-by-default", "fp4pass.checkpoint.convert replaces an output unasked", [
        ("fp4pass/checkpoint/run.py", "            overwrite: bool = False, show_progress: bool | None = None) -> dict:",
         "            overwrite: bool = True, show_progress: bool | None = None) -> dict:"),
    ], SWAP_TESTS),
    Mutant("swap-old-not-put-back", "a failed swap leaves the old folder in the temporary, which then goes", [
        ("def undo", "    os.rename(aside, target)\n    _fsync(target.parent)\n    return True\n", "    return True\n"),
    ], SWAP_TESTS),
    Mutant("swap-state-after-rename", "the swap's state is written after the old folder moved aside", [
        ("def swap", "    write_state(staging, target, identity)\n    try:\n        os.rename(target, staging / ASIDE)\n",
         "    try:\n        os.rename(target, staging / ASIDE)\n        write_state(staging, target, identity)\n"),
    ], SWAP_TESTS),
    Mutant("swap-recovery-takes-any-occupant", "a killed swap's old folder goes though another stands at its name", [
        ("def recover", "    return _identity(target) == state[\"new\"], None\n", "    return True, None\n"),
    ], SWAP_TESTS),
    Mutant("stale-sweep-never-recovers", "fp4pass clean removes a killed swap's temporary with the old folder", [
        ("def remove_stale", "            may_go, back = recover(path)\n", "            may_go, back = True, None\n"),
    ], SWAP_TESTS),
    Mutant("swap-state-any-name", "a swap state naming a path outside its folder is followed", [
        ("def read_state", "    if name in (\"\", \".\", \"..\") or \"/\" in name", "    if name in (\"\",)"),
    ], SWAP_TESTS),
    Mutant("temp-marker-read-unbounded-depth", "a temporary's marker is parsed however deep it nests", [
        ("def _marker", "    data = read_small_json(folder / MARKER, _MARKER_MAX, 2)",
         "    data = read_small_json(folder / MARKER, _MARKER_MAX, 10**9)"),
    ], SWAP_TESTS),
    Mutant("input-links-protect-whole-folders", "every folder an input's link leads into is refused for outputs", [
        ("def input_places", "                where = blobs if hub and os.path.dirname(real) == blobs else real\n",
         "                where = os.path.dirname(real)\n"),
    ], SWAP_TESTS),
    Mutant("overwrite-marker-names-unchecked", "a marker's listed names are walked whatever they are", [
        ("def _listed_files", "type(v) is int and v >= 0 and _plain_relative(k)", "type(v) is int and v >= 0"),
    ], SWAP_TESTS),
    Mutant("overwrite-marker-depth-off-by-one", "a listed file at the deepest allowed level is refused", [
        ("def _plain_relative", 'name.count("/") > MAX_LISTED_DEPTH', 'name.count("/") >= MAX_LISTED_DEPTH'),
    ], SWAP_TESTS),
    # -- the command line: flags, usage errors, --quiet, inputs of the wrong kind, NVFP4 inputs, --overwrite ------
    Mutant("quiet-passes-everything", "--quiet passes every bare print on", [
        ("def shown_from", "    if lowest > Level.INFO:\n        _real.update",
         "    if False:\n        _real.update"),
    ], USER_PATH_TESTS),
    Mutant("quiet-drops-errors", "--quiet drops the command's error line too", [
        ("def _run.fail", '        messages.error(f"fp4pass {name}: {message}")',
         '        messages.info(f"fp4pass {name}: {message}")'),
    ], USER_PATH_TESTS),
    Mutant("quiet-problems-hidden", "inspect NVFP4_DIR --quiet hides the problems and warnings it counts", [
        ("def _problems_when_quiet", "    if not messages.quiet():\n        return  # the report",
         "    if True:\n        return  # the report"),
    ], ROUND5_TESTS),
    Mutant("quiet-declined-as-info", "--allow-partial's weights left in MXFP4 are info (hidden under --quiet)", [
        ("fp4pass/commands/checkpoint.py", "messages.warning(declined_line(d), file=sys.stdout)",
         "messages.info(declined_line(d), file=sys.stdout)"),
    ], ROUND5_TESTS),
    Mutant("quiet-check-passed-shown", "--check's PASSED line is a warning (shown under --quiet)", [
        ("def convert_folder", 'messages.info(f"fp4pass convert: {check_line(',
         'messages.warning(f"fp4pass convert: {check_line('),
    ], ROUND5_TESTS),
    Mutant("quiet-engines-verdict-info", "no engine loading the output is info (hidden under --quiet)", [
        ("def convert_folder", "(messages.info if loads else messages.warning)(", "messages.info("),
    ], ROUND5_TESTS),
    Mutant("quiet-bare-print-shown", "a bare print passes the quiet level", [
        ("def _Hidden.write", "    def write(self, text: str) -> int:\n        return len(text)",
         "    def write(self, text: str) -> int:\n        return self._stream.write(text)"),
    ], ROUND5_TESTS),
    Mutant("quiet-python-warnings-hidden", "Python's warnings are dropped under --quiet", [
        ("def shown_from", "        warnings.showwarning = _show_python_warning",
         "        warnings.showwarning = lambda *a, **k: None"),
    ], ROUND5_TESTS),
    Mutant("startup-imports-torch", "fp4pass study's module imports torch, so every command's start does", [
        ("fp4pass/commands/study.py", "from fp4pass import messages\n",
         "import torch  # noqa: F401\nfrom fp4pass import messages\n"),
    ], ROUND5_TESTS),
    Mutant("data-flag-no-hint", "another command's calibration-data flag gets no hint naming this command's", [
        ("def _CommandParser.error", "        if wrong and hint:", "        if False:"),
    ], ROUND5_TESTS),
    Mutant("flags-abbreviated", "a shortened flag is taken for the one it starts (calibrate --calib as --calibrator)", [
        ("def _CommandParser.__init__", 'kwargs.setdefault("allow_abbrev", False)', 'kwargs.setdefault("allow_abbrev", True)'),
    ], ROUND5_TESTS),
    Mutant("diff-onnx-data-no-hint", "diff A.onnx B.onnx --data does not point at --inputs", [
        ("fp4pass/commands/doors.py", '    hints={"data": " (ONNX models take their inputs as --inputs DATA.npz)"}, model=',
         "    hints={}, model="),
    ], ROUND5_TESTS),
    Mutant("folder-inputs-no-hint", "convert CKPT_DIR --inputs does not point at --calib", [
        ("fp4pass/commands/doors.py", ',\n          "inputs": " (a checkpoint folder\'s calibration data is --calib DATA)"}', "}"),
    ], ROUND5_TESTS),
    Mutant("door-flag-default-counted", "a door's flag at its parser default counts as given (--seed 0 refused)", [
        ("def given", "    return getattr(args, dest, default) != default",
         "    return getattr(args, dest, default) is not None"),
    ], DOORS_TESTS),
    Mutant("door-nvfp4-flags-before-told", "inspect NVFP4_DIR --engine is refused before the folder is told NVFP4", [
        ("def _foreign", " and (settled or owner.within is not door)", ""),
    ], DOORS_TESTS),
    Mutant("door-parent-flags-refused", "an NVFP4 folder is refused the flags of every checkpoint folder", [
        ("def _foreign", "owner is not door and owner is not door.within and", "owner is not door and"),
    ], DOORS_TESTS),
    Mutant("door-kind-unworded", "inspect F.onnx --engine says F.onnx 'is not one' (an NVFP4 folder), not a folder", [
        ("def Door.refuse",
         'what = "one" if self.within is None or given is self.within else self.within.kind', 'what = "one"'),
    ], DOORS_TESTS),
    Mutant("door-command-wording-ignored", "diff's and inspect's own refusal lines replaced by the door's", [
        ("def refuse_foreign", "entrance.wording.get(owner.name)", "None"),
    ], DOORS_TESTS),
    Mutant("door-registry-typo-unchecked", "a door flag its command lacks goes unnoticed (a typo in the table)", [
        ("def open_doors", "    if missing:\n        raise AssertionError",
         "    if False:\n        raise AssertionError"),
    ], DOORS_TESTS),
    Mutant("forms-suffix-spelled-in-plan", "the copied modules found by a '.weight' spelled in plan.py", [
        ("def kept_modules", "name.endswith(WEIGHT_SUFFIX)", 'name.endswith(".weight")'),
    ], FORMS_USED_TESTS),
    Mutant("forms-suffix-spelled-in-detect", "DeepSeek-V4's block scales found by a '.scale' spelled in detect.py", [
        ("fp4pass/checkpoint/detect.py", "scale_name = module + _DEEPSEEK_SCALES", 'scale_name = module + ".scale"'),
    ], FORMS_USED_TESTS),
    Mutant("ckpt-convert-progress-stalls", "the folder convert's bar never advances", [
        ("def write_shards", "                    advance(item.nbytes)\n", ""),
    ], ROUND5_TESTS),
    Mutant("ckpt-check-progress-off", "--check reading back shows no bar on a terminal", [
        ("def check_checkpoint", 'enabled=show_progress, unit="unit"', 'enabled=False, unit="unit"'),
    ], ROUND5_TESTS),
    Mutant("ckpt-progress-never-on-terminal", "the folder convert passes no terminal default to the bars", [
        ("fp4pass/commands/checkpoint.py", "show_progress=False if messages.quiet() else None",
         "show_progress=False"),
    ], ROUND5_TESTS),
    Mutant("strict-not-refused-for-folders", "calibrate CKPT_DIR --strict is accepted and does nothing", [
        ("fp4pass/commands/doors.py", '"onnx": ("provider", "strict", "activation", "allow_invalid"),',
         '"onnx": ("provider", "activation", "allow_invalid"),'),
    ], ROUND5_TESTS),
    Mutant("allow-invalid-not-refused-for-folders", "inspect CKPT_DIR --allow-invalid is accepted and does nothing", [
        ("fp4pass/commands/doors.py", '    "onnx": ("allow_invalid",),\n}, wording=', '    "onnx": (),\n}, wording='),
    ], ROUND5_TESTS),
    Mutant("scales-report-not-recognized", "--scales given a calibration report says only what it expected", [
        ("def ActivationScales.from_json", 'if isinstance(data, dict) and isinstance(data.get("tensors"), list):',
         "if False:"),
    ], ROUND5_TESTS),
    Mutant("onnx-output-folder-late", "convert -o NEWDIR/ of an ONNX model speaks of its external data", [
        ("def _check_before_work", "    _refuse_folder_output(args.output, args.model)\n", ""),
    ], ROUND5_TESTS),
    Mutant("hub-hint-drops-revision", "the offline Hub hint fetches the default branch, not the @rev asked for", [
        ("def resolve_checkpoint", '(f" --revision {revision}" if revision else "")', '""'),
    ], ROUND5_TESTS),
    Mutant("json-without-provenance", "a JSON file fp4pass writes does not say which fp4pass and command wrote it", [
        ("def stamped", "    return {KEY: provenance(args, with_source), **data}",
         "    return data"),
    ], ROUND5_TESTS),
    Mutant("provenance-local-revision", "a local folder is given its folder name as a Hub revision", [
        ("def provenance", "resolved.name if from_hub else None", "resolved.name"),
    ], ROUND5_TESTS),
    Mutant("ckpt-table-without-header", "the folder convert table has no header", [
        ("fp4pass/checkpoint/run.py", 'SNR vs MXFP4"] if report["tensors"] else []', 'SNR vs MXFP4"] if False else []'),
    ], ROUND5_TESTS),
    Mutant("left-out-not-named", "sub-folders left out of the output (original/) are not mentioned", [
        ("fp4pass/commands/checkpoint.py", '    if report.get("not_copied"):  # original/',
         "    if False:  # original/"),
    ], ROUND5_TESTS),
    Mutant("examples-error-prefix", "python -m fp4pass.examples.checkpoints EXISTING has no fp4pass error line", [
        ("fp4pass/examples/checkpoints.py", 'f"fp4pass examples.checkpoints: error: ', 'f"{p.prog}: error: '),
    ], ROUND5_TESTS),
    Mutant("docs-exit-status-attribute", "docs/checkpoint.md names exit_status as an attribute of the function", [
        ("docs/checkpoint.md", "(after `from fp4pass.checkpoint.validate import exit_status`, `exit_status(result, ",
         "(`fp4pass.checkpoint.validate.exit_status(result, "),
    ], ROUND5_TESTS),
    Mutant("docs-checkpoint-without-overwrite", "docs/checkpoint.md converts into the README's OUT_DIR again", [
        ("docs/checkpoint.md", "--scales scales.json --overwrite\n", "--scales scales.json\n"),
    ], ROUND5_TESTS),
    Mutant("quiet-onnx-problems-hidden", "inspect NVFP4.onnx --quiet exits 1 without naming the problem", [
        ("fp4pass/commands/inspect.py", "    if problems and not args.json and messages.quiet():", "    if False:"),
    ], ROUND5_TESTS),
    Mutant("quiet-diff-verdict-dropped", "diff --quiet exits 1 without saying it failed", [
        ("fp4pass/commands/diff.py", "    if not result.passed and messages.quiet():", "    if False:"),
    ], ROUND5_TESTS),
    Mutant("calibrator-flag-without-data", "a calibrator flag without --calib is ignored", [
        ("def check_calibrator_flags", "    if given and not data_given:", "    if False:"),
    ], USER_PATH_TESTS),
    Mutant("calibrator-option-of-another", "an option of another calibrator than the chosen one is ignored", [
        ("def check_calibrator_flags", "if owner != chosen and getattr(args, dest, None) is not None:",
         "if False:"),
    ], USER_PATH_TESTS),
    Mutant("common-flag-before-command", "fp4pass --quiet convert gets argparse's bare unrecognized arguments", [
        ("def _TopParser.parse_known_args", "                if early:\n", "                if False:\n"),
    ], USER_PATH_TESTS),
    Mutant("choice-without-hint", "an invalid choice gets no 'did you mean'", [
        ("def _choice_hint", 'return f" (did you mean {close[0]}?)" if close else ""', 'return ""'),
    ], USER_PATH_TESTS),
    Mutant("usage-in-full", "a usage error prints argparse's whole usage", [
        ("def _Parser.error", 'self.exit(2, f"{self.short_usage()}\\n{self.prog}',
         'self.print_usage(sys.stderr)\n        self.exit(2, f"{self.prog}'),
    ], USER_PATH_TESTS),
    Mutant("shard-file-taken", "a .safetensors shard given for its folder is read as an ONNX file", [
        ("def refuse_checkpoint_file", "    if name.endswith(CHECKPOINT_FILE_SUFFIXES):", "    if False:"),
    ], INPUT_TESTS),
    Mutant("text-data-for-onnx", "text calibration data given to an ONNX model is read as an .npz", [
        ("def refuse_text_data", "    if path is None or not os.fspath(path).endswith(TEXT_DATA_SUFFIXES):",
         "    if True:"),
    ], INPUT_TESTS),
    Mutant("npz-arrays-unnamed", "an .npz naming no graph input says only which input is missing", [
        ("def iter_feeds.npz", "        if extra and not feed:", "        if False:"),
    ], INPUT_TESTS),
    Mutant("scales-of-another-model", "a SCALES.json matching no module is not named as another model's", [
        ("def resolve_input_scales", "    if not found and result.unmatched:", "    if False:"),
    ], INPUT_TESTS),
    Mutant("nvfp4-onnx-converted-again", "an NVFP4 ONNX model gets 'no MXFP4 weights found'", [
        ("def _refuse_nvfp4_model", "    if mxfp4 or declined or not (weights or quantizers):",
         "    if True:"),
    ], INPUT_TESTS),
    Mutant("nvfp4-w4a4-quantized-twice", "a W4A4 model takes a second set of activation quantizers", [
        ("def _refuse_nvfp4_model", "    if (args.calib or args.scales) and not quantizers:",
         "    if args.calib or args.scales:"),
    ], INPUT_TESTS),
    Mutant("nvfp4-folder-converted-again", "an NVFP4 folder gets 'not MXFP4 ... --allow-partial'", [
        ("def refuse_nvfp4_folder", "    if not is_nvfp4_folder(folder, follow_symlinks=follow_symlinks):",
         "    if True:"),
    ], INPUT_TESTS),
    Mutant("nvfp4-alpha-read-as-dq", "an alpha-form weight's global scale read as its scale DQ's 1", [
        ("def _dq_weight", '            form, g = "alpha", alpha', "            pass"),
    ], INPUT_TESTS),
    Mutant("nvfp4-reference-quantizer-missed", "the standard-op emulation's activation quantizer is not found", [
        ("def _reference_quantizer", "    if not six:\n        return None", "    if True:\n        return None"),
    ], INPUT_TESTS),
    Mutant("nvfp4-zero-scale-passes", "a global or input scale of 0 is no problem", [
        ("def scale_value_problems", '("zero_scale", values == 0)', '("zero_scale", values != values)'),
    ], INPUT_TESTS),
    Mutant("nvfp4-negative-zero-code", "an E4M3 block scale with the sign bit is no problem", [
        ("def block_scale_problems", "(codes >= E4M3_SIGN) & (magnitude != 0)", "(codes > 0xFF) & (magnitude != 0)"),
    ], INPUT_TESTS),
    Mutant("nvfp4-problems-exit-0", "inspect exits 0 on an NVFP4 ONNX model with broken scales", [
        ("fp4pass/commands/inspect.py", "    return 1 if problems else 0", "    return 0"),
    ], INPUT_TESTS),
    Mutant("overwrite-any-folder", "--overwrite replaces a folder without fp4pass's marker", [
        ("def _listed_files", "    marker = _read_output_marker(target)\n    if marker is None:",
         "    marker = _read_output_marker(target) or {\"files\": {}}\n    if False:"),
    ], OVERWRITE_TESTS),
    Mutant("overwrite-marker-through-link", "a marker that is a symlink to one elsewhere is taken", [
        ("def read_small_json", "        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)",
         "        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)"),
    ], OVERWRITE_TESTS),
    Mutant("overwrite-without-the-flag", "an fp4pass folder is replaced without --overwrite", [
        ("def _replaceable", "    if not overwrite:\n        raise UsageError", "    if False:\n        raise UsageError"),
    ], OVERWRITE_TESTS),
    Mutant("overwrite-old-removed-first", "the old folder is removed before the new one is written", [
        ("def atomic_folder", "    staging = make_temp_folder(target)\n",
         "    staging = make_temp_folder(target)\n    if replacing:\n        shutil.rmtree(target)\n"),
    ], OVERWRITE_TESTS),
    Mutant("overwrite-unmarked-output", "output folders get no marker", [
        ("def atomic_folder", "        _write_output_marker(tmp)\n", ""),
    ], OVERWRITE_TESTS),
    Mutant("text-dropped-silently", "text past --num-samples x --seq-len is left out without a note", [
        ("def _note_dropped", "    if last_read is not None:\n", "    if False:\n"),
    ], OVERWRITE_TESTS),
    Mutant("text-tail-dropped-silently", "a tail too short for a sequence is left out without a note", [
        ("def _note_dropped", "    elif tail:\n", "    elif False:\n"),
    ], OVERWRITE_TESTS),
    Mutant("calibration-source-as-file", "convert --calib reports its input scales as from a SCALES.json", [
        ("def _load_scales", '        return scales, "calibration"', '        return scales, "SCALES.json"'),
    ], OVERWRITE_TESTS),
    # -- formats and conversion ---------------------------------------------------------------------------
    Mutant("nibble-order", "pack and unpack put element 2i in the HIGH nibble (formats packing)", [
        ("def pack_nibbles", "return (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)",
         "return (pairs[..., 1] & 0x0F) | ((pairs[..., 0] & 0x0F) << 4)"),
        ("def unpack_nibbles", "pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)",
         "pairs = torch.stack((packed >> 4, packed & 0x0F), dim=-1)"),
    ]),
    # The converter's pattern engine reads nibbles only through tables that treat both nibbles of a byte
    # alike (magnitude counts per 2-byte word, one magnitude map per byte applied to each nibble in place),
    # so a reversed order there is no bug; the QMoE kernel-layout repacking unpacks nibbles itself.
    Mutant("nibble-order-everywhere", "the same, and the QMoE kernel-layout repacking's own (un)packing too", [
        ("def pack_nibbles", "return (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)",
         "return (pairs[..., 1] & 0x0F) | ((pairs[..., 0] & 0x0F) << 4)"),
        ("def unpack_nibbles", "pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)",
         "pairs = torch.stack((packed >> 4, packed & 0x0F), dim=-1)"),
        ("def _repack", "codes[:, 0::2] = packed[i] & 0x0F\n        codes[:, 1::2] = packed[i] >> 4",
         "codes[:, 0::2] = packed[i] >> 4\n        codes[:, 1::2] = packed[i] & 0x0F"),
        ("def _repack", "out[i] = t[:, 0::2] | (t[:, 1::2] << 4)",
         "out[i] = t[:, 1::2] | (t[:, 0::2] << 4)"),
    ], ["tests/onnx/test_onnx_convert.py", "tests/onnx/test_qmoe_layout.py"]),
    Mutant("auto-without-mantissas", "auto (best) drops its 2^(k_max-8)/c candidates with c != 1", [
        ("def auto_candidates", "columns += [hybrid / c for c in MANTISSAS]\n", "columns += []\n"),
    ], ["tests/convert/test_convert.py"]),
    Mutant("auto-without-amax", "auto drops requant's candidate amax/(6*448)", [
        ("def auto_candidates", "columns.append(global_scale_from_amax(amax))", "pass"),
    ], ["tests/convert/test_convert.py"]),
    Mutant("auto-without-amax-codes", "auto (best) drops its candidates amax/(6*s), s = 256..416", [
        ("def auto_candidates",
         "columns += [(amax.double() / (6 * s)).float().clamp(min=GLOBAL_SCALE_MIN) for s in AMAX_CODES]",
         "pass"),
    ], ["tests/convert/test_convert.py"]),
    Mutant("auto-without-code-steps-2", "auto (best) drops the per-half codes s0 -+ 2", [
        ("fp4pass/convert/methods.py", 'AUTO_STEPS = {"fast": (0, -1, 1), "best": (0, -1, 1, -2, 2)}',
         'AUTO_STEPS = {"fast": (0, -1, 1), "best": (0, -1, 1)}'),
    ], ["tests/convert/test_convert.py"]),
    Mutant("verbatim-count-ignores-nibbles", "blocks16_verbatim counts exact halves whether or not the nibbles "
           "were kept (converter statistics measured against a reference)", [
        ("def measure_stats", "verbatim += int((same & exact).sum())", "verbatim += int(exact.sum())"),
    ], ["tests/convert/test_convert.py"]),
    Mutant("engine-verbatim-count-ignores-nibbles", "the same in the pattern search's statistics", [
        ("def choose", "exact_p = verbatim_p | (same & (sse_p == 0))",
         "exact_p = verbatim_p | (sse_p == 0)"),
    ], ["tests/convert/test_convert.py", "tests/onnx/test_onnx_convert.py"]),
    Mutant("expert-verbatim-count-ignores-nibbles", "the same in the report's per-expert statistics", [
        ("def group_stats", "verbatim += int((kept & exact).sum())", "verbatim += int(exact.sum())"),
    ]),
    Mutant("expert-stats-wrong-global-scale", "per-expert statistics decode every expert with expert 0's scale", [
        ("def group_stats", "global_scale[g]).dequantize()", "global_scale[0]).dequantize()"),
    ]),
    Mutant("inspect-forecast-hybrid", "inspect forecasts the error of hybrid instead of auto", [
        ("def _error_forecast", 'mxfp4_to_nvfp4(mx, method="auto", group_dims=group_dims)',
         'mxfp4_to_nvfp4(mx, method="hybrid", group_dims=group_dims)'),
    ]),
    # -- ONNX passes --------------------------------------------------------------------------------------
    Mutant("global-scale-axis", "the per-expert global scale's DequantizeLinear runs along axis 1, not 0", [
        ("def _scale_chain", 'attrs = {"axis": ir.AttrInt64("axis", 0)} if with_global',
         'attrs = {"axis": ir.AttrInt64("axis", 1)} if with_global'),
    ], ["tests/onnx/test_onnx_convert.py"]),
    Mutant("qmoe-kernel-pairs-along-k", "QMoE kernel-layout bytes are read and written as if paired along K "
           "(no repacking between [E, K, N/2] and [E, N, K/2])", [
        ("def kernel_to_schema", "return _repack(packed, k, n)",
         "return np.asarray(packed, np.uint8).reshape(-1, n, k // 2)"),
        ("def schema_to_kernel", "return _repack(packed, n, k)",
         "return np.asarray(packed, np.uint8).reshape(-1, k, n // 2)"),
    ], ["tests/onnx/test_qmoe_layout.py"]),
    Mutant("float-scale-any-is-pow2", "float-scale FP4 DQ takes any scale in range for a power of two "
           "(E8M0 code of floor(log2 s))", [
        ("def float_scales_to_e8m0", "pow2 = (mantissa == 0.5) & (k >= E8M0_MIN_EXP) & (k <= E8M0_MAX_EXP)",
         "pow2 = (k >= E8M0_MIN_EXP) & (k <= E8M0_MAX_EXP)"),
    ], ["tests/onnx/test_onnx_patterns.py", "tests/onnx/test_rewrite_common.py"]),
    Mutant("quark-scale-rule-ceil", "Quark's fake-quantized weights are read with the CEIL scale rule, not FLOOR", [
        ("fp4pass/onnx/quark_mx.py", "QUARK_SCALE_RULE = ScaleRule.FLOOR", "QUARK_SCALE_RULE = ScaleRule.CEIL"),
    ], ["tests/onnx/test_rewrite_quark.py"]),
    Mutant("fp16-alpha-cast-float", "the 16-bit alpha form casts the product back to FLOAT16 whatever the "
           "graph's type (BFLOAT16 graphs)", [
        ("def _multiply_output", '{"to": ir.AttrInt64("to", dtype)}, outputs=[scaled]',
         '{"to": ir.AttrInt64("to", ir.DataType.FLOAT16)}, outputs=[scaled]'),
    ], ["tests/onnx/test_onnx_dtypes.py"]),
    Mutant("shared-weight-first-reader-only", "a weight read by several dequantize nodes gets its new scales "
           "on the first reader only", [
        ("def _scale_chain", "    for reader in reader_nodes(record):\n",
         "    for reader in reader_nodes(record)[:1]:\n"),
    ], ["tests/onnx/test_onnx_sharing.py"]),
    Mutant("ort-external-data-folder", "onnxruntime sessions of in-memory models are not told where their "
           "external data lives", [
        ("def make_session", "options.add_session_config_entry(_EXTERNAL_FOLDER_KEY, folder)",
         "folder"),
    ], ["tests/onnx/test_numerics.py"]),
    Mutant("ort-small-external-left-external", "small external tensors (shape constants) are not read into the "
           "model before onnxruntime resolves its graph", [
        ("def _inline_small_external", "if 0 <= length <= _SMALL_EXTERNAL_BYTES:", "if False:"),
    ], ["tests/cli/test_cmd_bad_input.py"]),
    Mutant("quark-fold-any-attributes", "a Quark fake-quant on a constant is folded whatever its axis and block", [
        ("def fold_constants", "    reason = fold_reason(node)\n", "    reason = None\n"),
    ], ["tests/onnx/test_rewrite_quark.py"]),
    Mutant("fx-per-expert-stats-dropped", "fx.convert's report has no per-expert statistics for expert weights", [
        ("def MXFP4ToNVFP4FxPass._convert", "group_stats(mx, nv, group_dims, stats)", "group_stats(mx, nv, 0, stats)"),
    ], ["tests/fx/test_gpt_oss_e2e.py"]),
    Mutant("fx-export-bf16-rms-norm", "fx.export leaves RMSNormalization's bfloat16 input beside its FP32 scale", [
        ("def export", "    _widen_rms_norm_inputs(onnx_model)\n", "\n"),
    ], ["tests/fx/test_gpt_oss_e2e.py"]),
    Mutant("fx-copy-renames-builtin-input", "a copied fx graph keeps torch.fx's new names (nn.Sequential's "
           "placeholder input becomes input_1, which the program's signature does not name)", [
        ("def copy_graph_module", "            node.name = original.name  #", "            node.name = node.name  #"),
    ], ["tests/fx/test_fx_input_names.py"]),
    Mutant("fx-module-renames-builtin-input", "calibration runs program.module() as torch names it (input -> "
           "input_1), so the activation the program names input is not found", [
        ("def program_module", "        node.name = name\n", "        pass\n"),
    ], ["tests/fx/test_fx_input_names.py"]),
    # -- Hugging Face Hub model IDs ---------------------------------------------------------------------------
    Mutant("hub-id-beats-local-path", "a Hub ID is resolved even where a local folder of that name exists", [
        ("fp4pass/safetensors/hub.py", "if parsed is None or os.path.lexists(path_or_id):", "if parsed is None:"),
    ], ["tests/checkpoint/test_hub.py"]),
    Mutant("hub-revision-ignored", "name@rev resolves to the default branch", [
        ("def _snapshot", "snapshot_download(repo_id, revision=revision,", "snapshot_download(repo_id, revision=None,"),
    ], ["tests/checkpoint/test_hub.py"]),
    Mutant("hub-index-shards-not-checked", "a cached snapshot missing a shard its index names is taken as complete", [
        ("def missing_files", "        missing += [s for s in shards", "        missing + [s for s in shards"),
    ], ["tests/checkpoint/test_hub.py"]),
    Mutant("hub-subfolders-fetched", "downloads take sub-folders too (gpt-oss's original/ and metal/ weights)", [
        ("fp4pass/safetensors/hub.py", 'HUB_IGNORED = ("*/*",)', 'HUB_IGNORED = ()'),
    ], ["tests/checkpoint/test_hub.py"]),
    Mutant("hub-cache-not-first", "a complete cached snapshot is downloaded again (the Hub asked first)", [
        ("def resolve_checkpoint", "    if folder is not None and not missing:\n", "    if folder is not None and False:\n"),
    ], ["tests/checkpoint/test_hub.py"]),
    Mutant("hub-offline-ignored", "HF_HUB_OFFLINE set in the environment after import is not honoured", [
        ("def _offline", "    return env or bool(constants.HF_HUB_OFFLINE)", "    return bool(constants.HF_HUB_OFFLINE)"),
    ], ["tests/checkpoint/test_hub.py"]),
    Mutant("hub-cli-convert-unresolved", "fp4pass convert takes a Hub ID for an ONNX file", [
        ("def enter",
         "        setattr(args, entrance.model, resolve(getattr(args, entrance.model), args))\n", "        pass\n"),
    ], ["tests/checkpoint/test_hub.py"]),
    Mutant("hub-quiet-bars-shown", "--quiet leaves huggingface_hub's download bars on", [
        ("def _snapshot", "    hide = show_progress is False and", "    hide = show_progress is None and"),
    ], ["tests/checkpoint/test_hub.py"]),
    Mutant("checkpoint-counts-call-weights-experts", "inspect's and convert's summaries call every MXFP4 weight an "
           "expert (the DeepSeek-V3-architecture example's attention o_proj too)", [
        ("fp4pass/checkpoint/inspection.py", "/{s['experts_total']} forecast lossless\"",
         "/{s['experts_total']} experts forecast lossless\""),
        ("fp4pass/checkpoint/run.py", "/{s['experts_total']} lossless, ", "/{s['experts_total']} experts lossless, "),
    ], ["tests/project/test_docs_examples.py"]),
    Mutant("emulate-clamp-normal", "the activation quantizer clamps E4M3 block scales at 2^-6 instead of 2^-9", [
        ("def nvfp4_fake_quant", 'f"{p}/e4m3_min_subnormal", E4M3_MIN_SUBNORMAL, f32)',
         'f"{p}/e4m3_min_subnormal", 2.0**-6, f32)'),
    ], ["tests/onnx/test_emulate.py", "tests/onnx/test_act_quant.py", "tests/onnx/test_lower.py"]),
    Mutant("alpha-applied-twice", "the alpha form multiplies the consumer's alpha by the input scale twice", [
        ("def _scale_alpha", "values = alpha.const_value.numpy().astype(np.float32) * np.float32(input_scale)",
         "values = alpha.const_value.numpy().astype(np.float32) * np.float32(input_scale) * np.float32(input_scale)"),
    ], ["tests/onnx/test_act_quant.py"]),
    Mutant("lowering-quantize-axis", "the lowering's GatherBlockQuantized quantizes along axis 0", [
        ("def _dequant_gbq", '"quantize_axis": rank - 1,', '"quantize_axis": 0,'),
    ], ["tests/onnx/test_lower.py", "tests/onnx/test_numerics.py", "tests/cli/test_cmd_diff.py"]),
    Mutant("check-default-threshold-ignored", "convert --check without --snr-min applies no threshold", [
        ("def _check_before_work",
         "return SNR_MIN_WITH_ACTIVATIONS if (args.calib or args.scales) else SNR_MIN_WEIGHT_ONLY", "return None"),
    ], ["tests/cli/test_cmd_outputs.py"]),
    # -- calibration --------------------------------------------------------------------------------------
    Mutant("input-scale-formula", "the NVFP4 global scale (and input_scale) = amax / 448 instead of amax / (6 * 448)", [
        ("def global_scale_from_amax", "(amax / NVFP4_AMAX_PER_GLOBAL_SCALE)", "(amax / 448.0)"),
    ], CALIB_TESTS + ["tests/onnx/test_act_quant.py"]),
    Mutant("histogram-percentile-off-by-one", "the log histogram's percentile reads the next bin", [
        ("def LogHistogram.percentile",
         "index = int(torch.searchsorted(cum, torch.tensor([rank], dtype=torch.float64)).clamp(max=self.bins - 1))",
         "index = min(int(torch.searchsorted(cum, torch.tensor([rank], dtype=torch.float64))) + 1, self.bins - 1)"),
    ], CALIB_TESTS),
    Mutant("headroom-rho-ignored", "the headroom calibrator uses its default rho whatever it is given", [
        ("def HeadroomCalibrator.compute", 'return self.rho * b_min, "rho*B_min"', 'return 16384.0 * b_min, "rho*B_min"'),
    ], ["tests/calib/test_calib_calibrators.py"]),
    Mutant("distributed-amax-sum", "the distributed reduction adds the ranks' amax instead of taking their max", [
        ("def all_reduce_stats", "for s in stats]), dist.ReduceOp.MAX, device, group)",
         "for s in stats]), dist.ReduceOp.SUM, device, group)"),
    ], ["tests/calib/test_calib_distributed.py"]),
    Mutant("calib-loads-onnx", "the neutral fp4pass.calib loads onnx_ir, so a checkpoint calibration does too", [
        ("fp4pass/calib/__init__.py", "from fp4pass.calib.compute import scale_for\n",
         "from fp4pass.calib.compute import scale_for\nimport onnx_ir  # noqa: F401\n"),
    ], ["tests/project/test_layering.py"]),
    # -- the E2M1 byte tables (fp4pass.formats.byte_tables) ----------------------------------------------------
    Mutant("byte-table-nibbles-swapped", "a byte's high nibble decoded as its first element", [
        ("def _byte_values_cpu", "[lut[codes & 0x0F], lut[codes >> 4]]", "[lut[codes >> 4], lut[codes & 0x0F]]"),
    ], ["tests/formats/test_byte_tables.py"]),
    Mutant("byte-table-word-bytes-swapped", "a little-endian word's second byte decoded first", [
        ("def word_values.build", "[pairs[low], pairs[high]]", "[pairs[high], pairs[low]]"),
    ], ["tests/formats/test_byte_tables.py"]),
    Mutant("byte-table-cache-ignores-dtype", "the word table cached per device only: bf16 asked, float32 given", [
        ("def word_values", '("words", device, dtype)', '("words", device)'),
    ], ["tests/formats/test_byte_tables.py"]),
    Mutant("byte-table-scale-rows-shifted", "the scaled pairs of scale code s multiplied by code s+1's multiplier", [
        ("def scaled_pairs", "multipliers.reshape(256, 1, 1)", "multipliers.roll(-1).reshape(256, 1, 1)"),
    ], ["tests/formats/test_byte_tables.py"]),
    Mutant("byte-table-private-cache", "the NVFP4 reader keeps a word table of its own", [
        ("fp4pass/checkpoint/nvfp4_weights.py", "from fp4pass.formats.byte_tables import word_values\n",
         "_OWN = {}\n\n\ndef word_values(device):\n    if device not in _OWN:\n"
         "        w = torch.arange(65536, dtype=torch.int32, device=device)\n        _OWN[device] = torch.stack("
         "[decode_e2m1(((w >> s) & 15).to(torch.uint8)) for s in (0, 4, 8, 12)], -1)\n    return _OWN[device]\n"),
    ], ["tests/formats/test_byte_tables.py"]),
    Mutant("lossless-range-strict", "a spread of exactly 17 (18 exponents, E4M3's whole exact window) taken as lossy", [
        ("def lossless_range", "return k_max - k_min <= LOSSLESS_SPREAD", "return k_max - k_min < LOSSLESS_SPREAD"),
    ], ["tests/formats/test_scale_checks.py"]),
    Mutant("scale-check-ff-not-nan", "E4M3FN 0xFF (negative NaN) not taken for NaN", [
        ("def block_scale_problems", "nan = magnitude == E4M3_NAN_MAGNITUDE", "nan = codes == E4M3_NAN_MAGNITUDE"),
    ], ["tests/formats/test_scale_checks.py"]),
    Mutant("scale-check-minus-zero-negative", "an E4M3 block scale of -0 (0x80) called negative", [
        ("def block_scale_problems", "(codes >= E4M3_SIGN) & (magnitude != 0) & ~nan", "(codes >= E4M3_SIGN) & ~nan"),
    ], ["tests/formats/test_scale_checks.py"]),
    Mutant("json-integer-digits-unbounded", "a JSON integer of any length parsed (SCALES.json's 300-digit count)", [
        ("def strict_json", "                      parse_int=_bounded_int)", "                      )"),
    ], ["tests/campaigns/test_input_files.py"]),
    Mutant("scale-check-minus-inf-negative", "a global scale of -inf also called negative", [
        ("def scale_value_problems", "finite & (values < 0)", "(values < 0)"),
    ], ["tests/formats/test_scale_checks.py"]),
    Mutant("fx-own-header-check", "the fx door's gpt-oss loader opens shards without the shared header check", [
        ("def _open", "        SafetensorsFile(file)\n", "        pass\n"),
    ], ["tests/fx/test_gpt_oss_load_errors.py"]),
    Mutant("opset-pass-not-told-of-dq", "the opset pass configured without the rewrite's result: no FP4 DQ seen", [
        ("def run_weight_passes", "SetOpsetAndIR(rewrite.wrote_dq)", "SetOpsetAndIR(False)"),
    ], ["tests/onnx/test_onnx_passes.py"] + CONVERT_TESTS),
    Mutant("pass-results-out-of-order", "run_passes hands back the passes' results last first", [
        ("def _Kept.call", "        self.results.append(result)\n", "        self.results.insert(0, result)\n"),
    ], ["tests/onnx/test_onnx_passes.py"]),
    Mutant("ort-versions-not-told-of-emulation", "SetOrtVersions configured as if no quantizer was emulated", [
        ("def lower", "SetOrtVersions(emulated=bool(results[0].lowered),", "SetOrtVersions(emulated=False,"),
    ], ["tests/onnx/test_onnx_passes.py", "tests/onnx/test_lower.py"]),
    Mutant("ort-versions-emulated-functions-dropped", "a function whose quantizer was emulated keeps its opset", [
        ("def lower", "emulated_functions=results[0].functions)", "emulated_functions=[])"),
    ], ["tests/onnx/test_onnx_passes.py", "tests/onnx/test_lower.py"]),
    # -- slots that could be confused (mutation tools change operators and constants, not which slot is read) --
    Mutant("qmoe-fc2-prior-from-fc1", "fc2's prior global scale is read from fc1's fc1_global_scale input", [
        ("def prior_global_scale", "gi = QMOE_WEIGHTS[record.slot][2]", 'gi = QMOE_WEIGHTS["fc1"][2]'),
    ], ["tests/onnx/test_node_declines.py"]),
    Mutant("gbq-any-float-scale", "GatherBlockQuantized float scales are not checked for powers of two", [
        ("def GatherBlockQuantizedFp4.check", "        return _power_of_two_reason(s)\n", "        return None\n"),
        ("def e8m0_codes_from_float", "if not (np.all(mantissa == 0.5) and np.all((codes >= 0) & (codes < E8M0_NAN))):",
         "if not np.all((codes >= 0) & (codes < E8M0_NAN)):"),
    ], ["tests/onnx/test_node_declines.py"]),
    Mutant("qmoe-model-metadata-first", "the model's layout metadata overrides the node's", [
        ("def _hint", "    value = node.metadata_props.get(LAYOUT_KEY)\n    if value in LAYOUT_SHAPES:\n"
         "        return value, f\"node metadata {LAYOUT_KEY}={value}\"\n    value = hints.metadata.get(LAYOUT_KEY)\n",
         "    value = hints.metadata.get(LAYOUT_KEY)\n    if value in LAYOUT_SHAPES:\n"
         "        return value, f\"model metadata {LAYOUT_KEY}={value}\"\n    value = node.metadata_props.get(LAYOUT_KEY)\n"),
    ], ["tests/onnx/test_qmoe_layout.py"]),
    Mutant("qmoe-global-scale-unchecked", "QMoE fc*_global_scale inputs are not validated", [
        ("def QMoEFp4.check", "        reason = _qmoe_global_scales_reason(node)\n", "        reason = None\n"),
    ], ["tests/onnx/test_node_declines.py"]),
    Mutant("npz-header-unchecked", "calibration arrays are read whole before their rank is checked", [
        ("def _member", "        if check is not None:\n            check(name, shape, dtype)\n", ""),
    ], ["tests/checkpoint/test_calib_data_files.py"]),
    Mutant("scales-json-duplicates-kept", "SCALES.json keeps the last of two equal keys", [
        ("def strict_json", "object_pairs_hook=no_duplicate_keys, parse_constant=constant,",
         "parse_constant=constant,"),
    ], ["tests/campaigns/test_input_files.py"]),
    # -- writing outputs (fp4pass.io's context managers are decorated: mutmut leaves them alone) ------------
    Mutant("atomic-output-renames-a-failed-writer", "atomic_output renames the temporary in even when the "
           "block raised", [
        ("def atomic_output", "        yield tmp\n        if tmp.exists():\n            finish(tmp, target, kind)\n",
         "        try:\n            yield tmp\n        finally:\n            if tmp.exists():\n"
         "                finish(tmp, target, kind)\n"),
    ], ["tests/base/test_io.py"]),
    Mutant("atomic-output-leaves-stale-temporaries", "atomic_output no longer removes dead runs' temporaries", [
        ("def atomic_output", "    target = output_target(path)\n    remove_stale(folder)\n",
         "    target = output_target(path)\n"),
    ], ["tests/base/test_io.py"]),
    Mutant("finish-trusts-the-first-look", "the rename does not ask again what stands at the output's name (the "
           "API's save has no earlier check)", [
        ("def finish", "    target = output_target(target)\n    fsync_path(tmp)\n", "    fsync_path(tmp)\n"),
    ], ["tests/onnx/test_loading_external.py"]),
    Mutant("save-model-before-data", "save renames the model in before the data file it names", [
        ("def save", "        if use_external:\n            # The data lands first; the model that "
         "names it is renamed in last.\n            fio.finish(staging / data_name, path.parent / data_name)\n"
         "        fio.finish(staged, path)\n",
         "        fio.finish(staged, path)\n        if use_external:\n"
         "            fio.finish(staging / data_name, path.parent / data_name)\n"),
    ], ["tests/onnx/test_loading_external.py"]),
    Mutant("random-inputs-float64", "random float inputs are drawn in float64 and then copied", [
        ("def make_inputs", "rng.standard_normal(dims, dtype=np.float32).astype(dtype, copy=False)",
         "rng.standard_normal(dims).astype(np.float32).astype(dtype)"),
    ], ["tests/campaigns/test_random_inputs.py"]),
    # -- reading only inside a model's folder, writing only what is ours ----------------------------------
    Mutant("external-data-prefix-check", "external data is inside the folder when its path starts with it", [
        ("fp4pass/onnx/loading.py", "    return os.path.commonpath([real, base_real]) == base_real",
         "    return real.startswith(base_real)"),
    ], ["tests/onnx/test_loading_external.py"]),
    Mutant("proto-external-data-unchecked", "a ModelProto's external data is read without a location check", [
        ("def load", "        check_external_data(loaded.model, tensor.base_dir, where, only=tensor)",
         "        pass"),
    ], ["tests/onnx/test_loading_external.py"]),
    Mutant("function-constants-unwalked", "Constant values in local functions are not among the external tensors", [
        ("def external_tensors",
         '    scopes = [("", model.graph)] + [(f"function {f.name!r} ", f) for f in model.functions.values()]',
         '    scopes = [("", model.graph)]'),
    ], ["tests/onnx/test_loading_external.py"]),
    Mutant("output-data-file-not-an-input-check", "the output's .data file is not checked against the input's", [
        ("fp4pass/pipeline.py",
         '        refuse_overwrite(Path(output).with_name(Path(output).name + ".data"), *input_files)', ""),
        ("def save", "        if os.path.realpath(data_path) in external_data_files(model) or any(",
         "        if False and any("),
    ], ["tests/onnx/test_loading_external.py"]),
    Mutant("rename-over-symlink", "an output that is a symlink out of its folder is renamed over", [
        ("def finish", "    target = output_target(target)\n    fsync_path(tmp)", "    fsync_path(tmp)"),
        ("def check_outputs", "        output_target(out, label)\n", ""),
        ("def atomic_output", "    target = output_target(path)\n    remove_stale(folder)", "    target = Path(path)\n    remove_stale(folder)"),
    ], ["tests/base/test_io.py", "tests/onnx/test_loading_external.py"]),
    Mutant("rollback-by-name", "a failed run removes whatever file now has its output's name", [
        ("def OutputSession.rollback", "            if identity is None or (st.st_dev, st.st_ino) != identity:", "            if False:"),
    ], ["tests/base/test_io.py"]),
    Mutant("stale-by-pid-only", "temporaries of another host or pid namespace are judged by their pid here", [
        ("def _is_stale", "    here = marker[\"host\"] == token\n", "    here = True\n"),
    ], ["tests/base/test_io.py"]),
    Mutant("rename-before-fsync", "the temporary is renamed onto the target before it is fsynced", [
        ("def finish", "    fsync_path(tmp)\n    os.chmod(tmp, 0o666 & ~current_umask())\n",
         "    os.chmod(tmp, 0o666 & ~current_umask())\n"),
        ("def finish", "    os.replace(tmp, target)\n    fsync_folder(target.parent)\n",
         "    os.replace(tmp, target)\n    fsync_path(target)\n    fsync_folder(target.parent)\n"),
    ], ["tests/base/test_io.py"]),
    Mutant("reports-kept-on-any-failure", "a failed run keeps its reports whatever the exit code", [
        ("def OutputSession.rollback", "            if kind == REPORT and code == 1:", "            if kind == REPORT:"),
    ], ["tests/base/test_io.py"]),
    # -- checkpoints ----------------------------------------------------------------------------------------
    Mutant("checkpoint-folder-renamed-before-fsync", "an output folder is renamed into place before its files "
           "are fsynced", [
        ("def atomic_folder", "        _fsync_tree(tmp)\n        st = os.lstat(tmp)\n",
         "        st = os.lstat(tmp)\n"),
        ("def atomic_folder", "                os.replace(tmp, target)\n                fsync_folder(parent)\n",
         "                os.replace(tmp, target)\n                _fsync_tree(target)\n                fsync_folder(parent)\n"),
    ], CHECKPOINT_TESTS),
    # -- checkpoint folders as hostile input, and what a run may remove ---------------------------------------
    Mutant("symlink-rule-follows-any-link", "a symlink out of a checkpoint folder is read like a file of it", [
        ("def member_path", "    if not stat.S_ISLNK(info.st_mode) or follow_symlinks:\n",
         "    if True:\n"),
    ], ["tests/campaigns/test_fuzz_checkpoint.py"]),
    Mutant("hf-blob-of-any-repository", "any folder named blobs counts as the snapshot's own blob store", [
        ("def _hf_blob", "            and real.parent.parent == base.parent.parent)", "            )"),
    ], ["tests/campaigns/test_fuzz_checkpoint.py"]),
    Mutant("pseudo-files-read", "files of procfs and sysfs are read like any regular file", [
        ("def pseudo_filesystem", "        return kind if kind in PSEUDO_FILESYSTEMS else None", "        return None"),
        ("def pseudo_filesystem", "            if os.stat(root).st_dev == info.st_dev:", "            if False:"),
    ], ["tests/campaigns/test_fuzz_checkpoint.py", "tests/base/test_io.py"]),
    Mutant("size-not-checked-at-eof", "a file that goes on past its st_size is read or copied without a word", [
        ("def copy_regular_file", "            if extra:\n", "            if False:\n"),
    ], ["tests/campaigns/test_fuzz_checkpoint.py"]),
    Mutant("sweep-ignores-the-marker-inode", "a copy of a dead run's temporary (another inode) is swept too", [
        ("def _marker", "    if (data.get(\"dev\"), data.get(\"ino\")) != (st.st_dev, st.st_ino):\n        return None\n",
         ""),
    ], ["tests/base/test_io.py"]),
    Mutant("sweep-trusts-a-reused-pid", "a live pid counts as the run that wrote the marker, whatever its start time",
           [("def _alive_here", "    return now is None or marker.get(\"start\") is None or now == marker.get(\"start\")",
             "    return True")], ["tests/base/test_io.py"]),
    Mutant("clean-older-than-removes-live-runs", "--older-than removes a run alive here", [
        ("def _is_stale", "    if here and _alive_here(marker):\n        return False\n    if here:\n        return True\n",
         "    if here and not _alive_here(marker):\n        return True\n"),
    ], ["tests/base/test_io.py"]),
    Mutant("sweep-removes-the-input", "the sweep before a checkpoint conversion may remove the run's own input", [
        ("def remove_stale", "            if (st.st_dev, st.st_ino) in kept:\n                continue\n", ""),
    ], ["tests/base/test_io.py"]),
    Mutant("folder-rename-not-recorded", "the output folder's rename is not recorded: a signal once the command "
           "has returned leaves OUT_DIR", [
        ("def atomic_folder", "                session.record(target, RESULT, identity)\n", "                pass\n"),
    ], ["tests/campaigns/test_fuzz_checkpoint.py"]),
    Mutant("folder-kept-when-its-fsync-fails", "a failure right after the folder's rename leaves it in place "
           "(outside the CLI's session)", [
        ("def atomic_folder", "            _remove_folder_if(target, identity, was_empty_folder)\n", "            pass\n"),
    ], ["tests/base/test_io.py", "tests/campaigns/test_fuzz_checkpoint.py"]),
    Mutant("report-after-the-rename", "--report is written once OUT_DIR is in place", [
        ("fp4pass/checkpoint/run.py", "                    if before_rename is not None:\n"
         "                        before_rename(report)  # the rename of out_dir comes after it, as the last step\n", ""),
        ("fp4pass/checkpoint/run.py", "            break\n    return report", "            break\n"
         "    if before_rename is not None:\n        before_rename(report)\n    return report"),
    ], ["tests/campaigns/test_fuzz_checkpoint.py"]),
    Mutant("shards-held-open", "every shard stays open from the catalog's opening on", [
        ("def SafetensorsFile", "        finally:\n            os.close(fd)\n\n    def _fail",
         "        except BaseException:\n            os.close(fd)\n            raise\n\n    def _fail"),
    ], ["tests/campaigns/test_fuzz_checkpoint.py"]),
    Mutant("tensor-count-not-capped", "a header may list any number of tensors", [
        ("def SafetensorsFile._parse", "        if raw.count(b\"{\") > 2 * limit + 2:", "        if False:"),
        ("def SafetensorsFile._parse", "        if len(header) > limit:", "        if False:"),
    ], ["tests/checkpoint/test_checkpoint_reader.py"]),
    Mutant("nan-in-config-taken", "NaN and Infinity in config.json or a header are read as numbers", [
        ("def strict_json", "    if constants:\n        raise ValueError(", "    if False:\n        raise ValueError("),
    ], ["tests/campaigns/test_fuzz_checkpoint.py", "tests/checkpoint/test_checkpoint_reader.py"]),
    Mutant("check-trusts-the-reader-everywhere", "--check never decodes in float64", [
        ("fp4pass/checkpoint/check.py", "        why = _why_float64(x, y)\n", "        why = None\n"),
        ("def _compare_bound", "    whys = [_why_float64(x, y) for x, y in zip(xs, ys)]",
         "    whys = [None for x, y in zip(xs, ys)]"),
    ], ["tests/campaigns/test_fuzz_checkpoint.py", "tests/campaigns/test_check_damaged_outputs.py"]),
    Mutant("check-pair-bound-per-tensor", "--check holds each half of a w1/w3 pair to its own plain requantization, "
           "not the pair to requantization under the scale it shares", [
        ("fp4pass/checkpoint/check.py", "        _compare_bound(names, xs, ys, reader, result, owns, stack_amax)\n",
         "        for one in zip(names, xs, ys, owns):\n"
         "            _compare_bound([one[0]], [one[1]], [one[2]], reader, result, [one[3]], stack_amax)\n"),
    ], ["tests/checkpoint/test_checkpoint_check_pairs.py"]),
    Mutant("check-pair-scale-from-w1", "--check's bound for a pair takes the shared global scale from w1's amax "
           "alone", [
        ("def _group_amax", "    return max(float(np.abs(x).max()) for x in xs)",
         "    return float(np.abs(xs[0]).max())"),
    ], ["tests/checkpoint/test_checkpoint_check_pairs.py"]),
    Mutant("check-pair-sum-over-w1-only", "--check sums a pair's squared error over w1 only", [
        ("def _compare_bound", "    sse = sum(errors)\n", "    sse = errors[0]\n"),
    ], ["tests/checkpoint/test_checkpoint_check_pairs.py"]),
    Mutant("check-pair-two-global-scales-taken", "--check passes a pair written with two different global scales", [
        ("def _unequal_global_scales", "    if all(torch.equal(w, written[0]) for w in written[1:]):", "    if True:"),
    ], ["tests/checkpoint/test_checkpoint_check_pairs.py"]),
    Mutant("check-stack-expert-own-scale", "--check holds each expert of a gpt-oss stack to requantization under "
           "its own amax, not the stack's one global scale", [
        ("def _check_fused", "multiplier)], stack_amax)", "multiplier)])"),
    ], ["tests/checkpoint/test_checkpoint_check_pairs.py"]),
    Mutant("check-stack-amax-low-nibbles", "--check's stack amax reads only the low nibble of each byte", [
        ("def _mxfp4_amax", "np.maximum(codes & 0x07, (codes >> 4) & 0x07)", "(codes & 0x07)"),
    ], ["tests/checkpoint/test_checkpoint_check_pairs.py"]),
    Mutant("checkpoint-pair-input-scale-from-one-half", "gate and up keep their own calibrated input scales "
           "instead of sharing the larger", [
        ("def resolve_input_scales", "                    found[n] = max(known)",
         "                    found[n] = found.get(n, max(known))"),
    ], CHECKPOINT_TESTS),
    Mutant("checkpoint-unrouted-expert-takes-min", "an expert calibration never reached takes its layer's "
           "smallest input scale, not the largest", [
        ("def resolve_input_scales",
         "            layer_max[group] = max(layer_max.get(group, 0.0), found[_name(item)])",
         "            layer_max[group] = min(layer_max.get(group, float('inf')), found[_name(item)])"),
    ], CHECKPOINT_TESTS),
    Mutant("checkpoint-pages-dropped-before-written", "the shard writer drops the pages of the step it has just "
           "started writing back, not the step before", [
        ("def ShardWriter._advance",
         "                if self._dropped < self._flushed:\n"
         "                    os.posix_fadvise(self._fd, self._dropped, self._flushed - self._dropped,",
         "                if self._flushed < self._position:\n"
         "                    os.posix_fadvise(self._fd, self._flushed, self._position - self._flushed,"),
    ], CHECKPOINT_TESTS),
    Mutant("checkpoint-direct-head-misread", "the bytes before a buffer's first whole 4 KiB block are counted "
           "from the block's start instead of up to it", [
        ("def ShardWriter.write_part", "head = -self._position % DIRECT_ALIGN",
         "head = self._position % DIRECT_ALIGN"),
    ], CHECKPOINT_TESTS),
    Mutant("checkpoint-fused-buffers-one-phase", "every expert of a gpt-oss stack is placed at the first "
           "expert's phase, so later experts miss the direct path", [
        ("def _write_fused", "(start + i * part) % DIRECT_ALIGN", "start % DIRECT_ALIGN"),
    ], CHECKPOINT_TESTS),
    # -- the validator and the engine rules under hostile input (a downloaded checkpoint's configs) ----------
    Mutant("glob-as-backtracking-regex", "a *-only glob is matched by the .*-regex SGLang builds (re backtracks "
           "for hours on *a*a*a*...*ab)", [
        ("def Glob.match",
         '        """Whether the whole of ``name`` matches (fnmatchcase); ``budget`` checked as it goes."""\n',
         '        """Whether the whole of ``name`` matches (fnmatchcase); ``budget`` checked as it goes."""\n'
         '        if "?" not in self.pattern and "[" not in self.pattern:\n'
         '            return re.fullmatch(self.pattern.replace(".", r"\\.").replace("*", ".*"), name, re.S) is not None\n'),
    ], HOSTILE_RULES_TESTS[:1]),
    Mutant("regex-without-timeout", "re: entries are matched with re, without a time limit", [
        ("def RegexList.__init__", "            self.compiled.append((label, rx.fullmatch if fullmatch else rx.match))",
         "            rx = re.compile(p)\n"
         "            self.compiled.append((label, (lambda f: lambda s, timeout: f(s))(rx.fullmatch if fullmatch "
         "else rx.match)))"),
    ], HOSTILE_RULES_TESTS[:1]),
    Mutant("invalid-regex-raises", "an invalid regex escapes as re.error (exit 3), not a bad_config_value", [
        ("def RegexList.__init__", "            except (re.error, RecursionError, OverflowError, ValueError) as exc:",
         "            except RecursionError as exc:"),
        ("def RegexList.__init__", "            except (regex.error, RecursionError, OverflowError, ValueError) as exc:",
         "            except RecursionError as exc:"),
    ], HOSTILE_RULES_TESTS[:1]),
    Mutant("non-string-entries-coerced", "exclusion entries that are not strings are read as their str()", [
        ("def entries", "    if set(map(type, value)) <= {str}:\n        return value\n",
         "    return [str(v) for v in value]\n"),
    ], HOSTILE_RULES_TESTS),
    Mutant("glob-index-tail-looked-up-as-head", "globs filed under their literal tail are looked up by the name's "
           "head", [
        ("def GlobIndex._match", "lambda k: name[n - k:])):", "lambda k: name[:k])):"),
    ], HOSTILE_RULES_TESTS[:1]),
    Mutant("sglang-ancestor-as-string-prefix", "SGLang's ancestor rule also takes a plain string prefix "
           "(model.layers.1 excludes model.layers.10)", [
        ("def SglangModelopt.path_match",
         '            return any(run in self.paths for run in dotted_runs(name.rstrip("."), self.path_dots, self.budget))',
         '            return any(run in self.paths for run in dotted_runs(name.rstrip("."), self.path_dots, self.budget)) '
         'or any(\n                name.startswith(p) for p in self.paths)'),
    ], HOSTILE_RULES_TESTS[:1]),
    Mutant("validator-trtllm-reads-config-json", "the validator holds TensorRT-LLM to config.json's exclusions", [
        ("def _exclusion_lists", "e.name: from_hq or from_qc if e.reads_first",
         "e.name: from_qc or from_hq if e.reads_first"),
    ], HOSTILE_RULES_TESTS[1:]),
    Mutant("verdict-trtllm-reads-config-json", "the engine verdicts read TensorRT-LLM's exclusions from config.json", [
        ("def _quant_config_for",
         '    if record.reads_first == QUANT_CONFIG_NAME and hf_quant is not None:',
         '    if record.reads_first == QUANT_CONFIG_NAME and hf_quant is not None and qc is None:'),
    ], HOSTILE_RULES_TESTS[:1]),
    Mutant("fused-shard-misspelt", "a shard of a fused module is misspelt (Qwen3-MoE v_porj, DeepSeek-V4 w_gate)", [
        ("fp4pass/checkpoint/families/qwen3_moe.py", '    vllm_fused={"qkv_proj": ("q_proj", "k_proj", "v_proj")',
         '    vllm_fused={"qkv_proj": ("q_proj", "k_proj", "v_porj")'),
        ("fp4pass/checkpoint/families/deepseek_v4.py", '"fused_wkv_wgate": ("wkv", "wgate")',
         '"fused_wkv_wgate": ("wkv", "w_gate")'),
    ], HOSTILE_RULES_TESTS[:1]),
    Mutant("dense-layer-wildcard-covers-later-layers", "a kept dense layer 1 is written as model.layers.1*, which "
           "also covers the NVFP4 layers 10..19 and 100..", [
        ("def _prefix_wildcard", "        if not any(c.startswith(ancestor) for c in converted):",
         '        if not any(c.startswith(ancestor + ".") for c in converted):'),
    ], HOSTILE_RULES_TESTS[:1]),
    Mutant("excluded-nvfp4-experts-unflagged", "an exclusion that covers a layer's NVFP4 experts is not a verdict", [
        ("def _exclusion_problems",
         '            if record.moe_layer_exclusion and rules.excluded(moe):',
         "            if False:"),
    ], HOSTILE_RULES_TESTS[:1]),
    Mutant("quant-config-link-followed", "the NVFP4 detection reads hf_quant_config.json through any symlink", [
        ("def _config_if_present",
         "    path = member(folder, name, follow_symlinks)\n    if not os.path.lexists",
         "    path = folder / name\n    if not os.path.lexists"),
    ], HOSTILE_RULES_TESTS[1:]),
    Mutant("unreadable-quant-config-taken-as-absent", "an hf_quant_config.json that cannot be read is taken as "
           "absent by the NVFP4 detection", [
        ("def _config_if_present", "        return {}\n    return read_json_file(path, name)\n",
         "        return {}\n    try:\n        return read_json_file(path, name)\n    except CheckpointError:\n"
         "        return {}\n"),
    ], HOSTILE_RULES_TESTS[1:]),
    Mutant("json-nan-printed", "inspect --json and the reports print a non-finite number as a bare NaN", [
        ("def json_text", "    clean, places = finite_json(data)\n", "    clean, places = data, []\n"),
        ("def json_text", "    return json.dumps(clean, indent=indent, allow_nan=False)",
         "    return json.dumps(clean, indent=indent)"),
    ], HOSTILE_RULES_TESTS[1:]),
    Mutant("verdict-exclusions-unchecked", "the engine verdicts take exclude_modules as any list", [
        ("def _modelopt_fields", "entries(q.get(\"exclude_modules\"), where), False, where",
         "list(q.get(\"exclude_modules\") or []), False, where"),
    ], HOSTILE_RULES_TESTS[:1]),
    # -- checkpoint calibration (one layer's statistics) ----------------------------------------------------
    Mutant("ckpt-calib-gate-up-down-swapped", "an expert's gate/up input lands in its down statistic and its "
           "intermediate activation in the gate/up one", [
        ("def _LayerStats.record", "        stats = self.stats.get((rel, expert, kind))\n",
         "        stats = self.stats.get((rel, expert, {\"gate_up\": \"down\", \"down\": \"gate_up\"}[kind]))\n"),
    ], CKPT_CALIB_TESTS),
    Mutant("ckpt-calib-tokens-of-the-next-expert", "each expert's row shows the next expert's token count (the "
           "last one none: unrouted)", [
        ("def _LayerStats.results", "                tokens = self.tokens.get((rel, e), 0)",
         "                tokens = self.tokens.get((rel, e + 1), 0)"),
    ], CKPT_CALIB_TESTS),
    Mutant("ckpt-calib-stack-takes-its-smallest-expert", "a gpt-oss stack's scale is its routed experts' "
           "smallest, not their largest", [
        ("def _LayerStats.results", "scale.g_amax > best[module].g_amax",
         "scale.g_amax < best[module].g_amax"),
    ], CKPT_CALIB_TESTS),
    Mutant("ckpt-calib-padding-counted", "an expert's padding rows (attention_mask 0) count in its statistics "
           "and its token count", [
        ("def _LayerStats.record", "            rows = rows[self.valid[token_idx]]\n",
         "            pass\n"),
    ], CKPT_CALIB_TESTS),
    Mutant("ckpt-calib-unrouted-expert-keyed", "an expert no token reached gets a key (its empty statistic's "
           "scale) instead of its layer's max at convert", [
        ("def _LayerStats.results", "                    if tokens == 0:\n                        continue\n",
         ""),
    ], CKPT_CALIB_TESTS),
    Mutant("ckpt-calib-rank-share-drops-the-rest", "under torch.distributed each rank takes a contiguous "
           "len // world batches, so the remainder is never calibrated", [
        ("def share_batches", "    return batches[dist.get_rank()::world]",
         "    n = len(batches) // world\n    return batches[dist.get_rank() * n:(dist.get_rank() + 1) * n]"),
    ], CKPT_CALIB_TESTS),
    # -- checkpoint calibration (the layer runner: weights, layer inputs, numerics) -------------------------
    Mutant("ckpt-calib-hf-gate-up-swapped", "Hugging Face expert names fill the up half with gate_proj and the "
           "gate half with up_proj (w1/w3 still right)", [
        ("def WeightSources.build", "[1 if proj in UP_NAMES else 0] = source",
         '[1 if proj in ("w3", "gate_proj") else 0] = source'),
    ], CKPT_CALIBRATE_TESTS),
    Mutant("ckpt-calib-hash-routing-stale-ids", "a layer's cached inputs keep the first batch's input_ids, so "
           "DeepSeek-V4's hash routing routes every later batch by them", [
        ("def LayerRunner.layer_inputs", '            kwargs = {**kwargs, "input_ids": input_ids.to(self.device)}',
         "            pass"),
    ], CKPT_CALIBRATE_TESTS),
    Mutant("ckpt-calib-layer-inputs-one-shape", "a layer's inputs (masks, rotary tables) are cached per layer, "
           "not per batch shape", [
        ("def LayerRunner.layer_inputs", "key = (index, tuple(input_ids.shape)) if", "key = (index,) if"),
    ], CKPT_CALIBRATE_TESTS),
    Mutant("ckpt-calib-fp8-scale-ignored", "FP8 E4M3 block-scaled weights are read without their block scales", [
        ("def WeightLoader._fp8", "        return weight * full\n", "        return weight\n"),
    ], CKPT_CALIBRATE_TESTS),
    Mutant("ckpt-calib-float32-linear-drops-bias", "a Linear run as float32 products loses its bias", [
        ("def _linear_in_float32", "    bias = None if linear.bias is None else linear.bias.float()",
         "    bias = None"),
    ], CKPT_CALIBRATE_TESTS),
    Mutant("ckpt-calib-stack-decoded-into-first-expert", "a stack stored in the checkpoint's order has every "
           "expert decoded into expert 0's slot", [
        ("def decode_experts", "out=out[i].t())", "out=out[0].t())"),
    ], CKPT_CALIBRATE_TESTS),
    Mutant("ckpt-calib-heap-not-trimmed", "a released layer's freed heap is kept (peak memory creeps with depth)", [
        ("def LayerRunner.release_layer", "        self.drop_cached(index)\n        return_freed_memory()\n",
         "        self.drop_cached(index)\n"),
    ], CKPT_CALIBRATE_TESTS),
    # -- checkpoint calibration: bugs nobody planned (padded batches, many experts, gpt-oss biases, hostile configs)
    Mutant("ckpt-runner-mask-lost", "the layer runner makes each layer's inputs without the batch's attention mask", [
        ("def LayerRunner",
         "attention_mask=None if attention_mask is None else attention_mask.to(self.device),",
         "attention_mask=None,"),
    ], CKPT_RUNNER_TESTS),
    Mutant("ckpt-runner-mask-of-an-earlier-batch", "a padded batch reuses the layer inputs (mask included) of an "
           "earlier batch of its shape", [
        ("def LayerRunner.layer_inputs",
         "key = (index, tuple(input_ids.shape)) if attention_mask is None else None",
         "key = (index, tuple(input_ids.shape))"),
    ], CKPT_RUNNER_TESTS),
    Mutant("ckpt-runner-mask-as-indices", "the statistics take the 0/1 mask as row indices, not as a mask", [
        ("def _Calibration.run_batch", "mask.reshape(-1).bool().to(self.dev)", "mask.reshape(-1).to(self.dev)"),
    ], CKPT_RUNNER_TESTS),
    Mutant("ckpt-runner-expert-index-one-digit", "an expert's index is read as its last digit (10 -> 0)", [
        ("def WeightSources.build", "                stack, e, proj = part\n",
         "                stack, e, proj = part\n                e = int(str(e)[-1])\n"),
    ], CKPT_RUNNER_TESTS),
    Mutant("ckpt-runner-experts-sorted-as-text", "expert slot e gets the e-th expert in text order (0, 1, 10, 100, "
           "101, 102, 11, 2, ...)", [
        ("def WeightLoader._fill_experts", "found = parts.get(e, {})",
         "found = parts.get(sorted(parts, key=str)[e], {})"),
    ], CKPT_RUNNER_TESTS),
    Mutant("ckpt-runner-report-experts-as-text", "the report lists a stack's experts in text order", [
        ("def _LayerStats.results", 'for e in range(entry.get("experts", 0)):',
         'for e in sorted(range(entry.get("experts", 0)), key=str):'),
    ], CKPT_RUNNER_TESTS),
    Mutant("ckpt-runner-gpt-oss-bias-before-rounding", "gpt-oss's expert biases are added to the float32 products "
           "before their bf16 rounding", [
        ("def expert_projection.project",
         "        y = y.to(x.dtype)\n        return y + bias if bias is not None else y",
         "        return (y + bias if bias is not None else y).to(x.dtype)"),
    ], CKPT_RUNNER_TESTS),
    # -- the one layer loop (layerwise.runner.run_layers) and its visitors; private names kept private -------------
    Mutant("loop-last-outputs-dropped", "the loop keeps the last layer's inputs in place of its outputs, so the "
           "diff's logits come from the hidden states before the last layer", [
        ("def run_layers", "                    if keep_last or i + 1 < layers:\n",
         "                    if i + 1 < layers:\n"),
    ], LOOP_TESTS + DIFF_ORACLE_TESTS),
    Mutant("loop-outputs-of-the-first-runner", "the loop propagates the first runner's outputs into every runner's "
           "hidden states (the NVFP4 model fed the source's: end to end equals local)", [
        ("def run_layers", "                        for store, out in zip(stores, outputs):\n",
         "                        for store, out in zip(stores, [outputs[0]] * len(outputs)):\n"),
    ], LOOP_TESTS + DIFF_ORACLE_TESTS),
    Mutant("loop-hooks-left-installed", "the loop never removes a visitor's hooks (end_layer skipped, also when a "
           "batch fails)", [
        ("def run_layers", "            finally:\n                visitor.end_layer(i)\n",
         "            finally:\n                pass\n"),
    ], LOOP_TESTS),
    Mutant("loop-visitor-phase-not-timed", "the visitor's after-layer work (the calibration's scales) is not timed "
           "as its own phase", [
        ("def run_layers", "            if visitor.after_phase:\n", "            if False:\n"),
    ], LOOP_TESTS + CKPT_CALIB_TESTS),
    Mutant("private-name-imported", "calibration imports a private name of the layer model", [
        ("fp4pass/checkpoint/calibration.py",
         "from fp4pass.checkpoint.layerwise.model import experts_modules, resolve_architecture",
         "from fp4pass.checkpoint.layerwise.model import _rename, experts_modules, resolve_architecture"),
    ], ["tests/project/test_private_names.py"]),
    Mutant("ckpt-partial-earlier-declines-lost", "--allow-partial: a unit failing drops the declines made before it", [
        ("def _decline_unit", 'declined = found.declined + [{"tensor"', 'declined = [{"tensor"'),
    ], CKPT_RUNNER_TESTS),
    Mutant("ckpt-limits-layers-one-past-the-shards", "num_hidden_layers may name one layer more than the shards hold", [
        ("def check_config_fields", "        if layers > held:", "        if layers > held + 1:"),
    ], CKPT_HOSTILE_TESTS),
    Mutant("ckpt-limits-top-k-one-past", "num_experts_per_tok may exceed the experts by one", [
        ("def check_config_fields", "top_k > experts[1]:", "top_k > experts[1] + 1:"),
    ], CKPT_HOSTILE_TESTS),
    Mutant("ckpt-limits-shards-not-compared", "the model's sizes are not compared with the shards before the run", [
        ("fp4pass/checkpoint/calibration.py", "        check_fits_shards(catalog, found, model_type, cfg)",
         "        pass"),
    ], CKPT_HOSTILE_TESTS),
    Mutant("ckpt-limits-blames-every-factor", "a size that does not fit blames every field whose value divides it "
           "by another field's, beside the one that lies", [
        ("def _fields_behind", "    if alone:\n        return alone\n", ""),
    ], CKPT_HOSTILE_TESTS),
    Mutant("ckpt-limits-groups-unchecked", "DeepSeek's expert groups (n_group, topk_group) go unchecked", [
        ("def check_config_fields", "        _check_groups(config, where, *experts)\n", "        pass\n"),
    ], CKPT_HOSTILE_TESTS),
    Mutant("ckpt-limits-attention-unchecked", "sequences whose attention cannot fit go to the allocator", [
        ("fp4pass/checkpoint/calibration.py", "        check_attention_memory(cfg, every, dev, str(data))\n", ""),
    ], CKPT_HOSTILE_TESTS),
    Mutant("ckpt-text-row-tokenized-whole", "a .jsonl row is tokenized whole, however few tokens are wanted", [
        ("def _cut", "    if chars is None or len(text) <= chars:", "    if True:"),
    ], CKPT_HOSTILE_TESTS),
    Mutant("ckpt-text-txt-read-whole", "a .txt is read whole, however few tokens are wanted", [
        ("def _txt_row", "text = stream.read(-1 if chars is None else chars)",
         "text = stream.read()"),
    ], CKPT_HOSTILE_TESTS),
    Mutant("ckpt-text-row-limit-one-short", "a .jsonl row of exactly the row limit is refused", [
        ("def _jsonl_rows", "if len(raw) > ROW_LIMIT:", "if len(raw) >= ROW_LIMIT:"),
    ], CKPT_HOSTILE_TESTS),
    Mutant("ckpt-text-txt-limit-ignored", "a .txt past the text limit is read whole without --num-samples", [
        ("def _txt_row", "if chars is None and info.st_size > TEXT_LIMIT:", "if False:"),
    ], CKPT_HOSTILE_TESTS),
    Mutant("ckpt-text-surrogate-passed-on", "a .jsonl row is parsed by plain json (a lone surrogate reaches the "
           "tokenizer)", [
        ("def _jsonl_rows", "item = strict_json(raw)", "item = json.loads(raw)"),
    ], CKPT_HOSTILE_TESTS),
    # -- the CUDA checks' CPU parts: onnxruntime sessions, node placement, the GPU script ----------------------
    Mutant("ort-cuda-tf32-on", "CUDA sessions leave TF32 on (float32 MatMuls in 10-bit mantissas)", [
        ("fp4pass/onnx/runtime.py", 'CUDA_OPTIONS = {"use_tf32": "0"}', 'CUDA_OPTIONS = {"use_tf32": "1"}'),
    ], ORT_CUDA_TESTS),
    Mutant("ort-cuda-options-not-passed", "the CUDA EP gets no provider options", [
        ("def _providers", "return [(_CUDA_EP, dict(CUDA_OPTIONS)), _CPU_EP]", "return [_CUDA_EP, _CPU_EP]"),
    ], ORT_CUDA_TESTS),
    Mutant("ort-preload-chatter-shown", "what onnxruntime's preload_dlls prints reaches the user's terminal", [
        ("def _preload_cuda_libraries", "        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):\n",
         "        if True:\n"),
    ], ORT_CUDA_TESTS),
    Mutant("placement-constant-chain-ignored", "a MatMul reading a dequantized or transposed weight is not a "
           "weight node", [
        ("def weight_nodes", "            if any(v in weight for v in inputs):\n                weight.update(",
         "            if False:\n                weight.update("),
    ], ORT_CUDA_TESTS),
    Mutant("placement-memcpy-counted", "onnxruntime's own Memcpy nodes count as model nodes", [
        ("def node_placement", 'if node in seen or op_type.startswith("Memcpy"):', "if node in seen:"),
    ], ORT_CUDA_TESTS),
    Mutant("placement-prefix-match", "a node counts as a weight node when its name starts like one", [
        ("def node_placement", "reads_weights = node in weights or",
         "reads_weights = any(node.startswith(w) for w in weights) or"),
    ], ORT_CUDA_TESTS),
    Mutant("placement-any-cpu-node", "any node on the CPU (shape arithmetic too) makes the label 'cuda (N on cpu)'", [
        ("def Placement.provider_label", "        if not self.weight_nodes_on_cpu:\n            return \"cuda\"",
         "        if not self.on_cpu:\n            return \"cuda\""),
    ], ORT_CUDA_TESTS),
    Mutant("placement-fusions-ignored", "a node onnxruntime fused under a new name never counts as a weight node", [
        ("def node_placement", "(node not in names and op_type in _WEIGHT_OPS)", "False"),
    ], ORT_CUDA_TESTS),
    Mutant("diff-notes-not-in-json", "diff --json drops the notes", [
        ("def DiffResult.to_json", '"notes": list(self.notes),', '"notes": [],'),
    ], ORT_CUDA_TESTS),
    Mutant("diff-notes-not-in-table", "format_table leaves the notes out", [
        ("def DiffResult.format_table", 'lines.extend(f"note: {note}" for note in self.notes)', "lines.extend([])"),
    ], ORT_CUDA_TESTS),
    Mutant("gpu-check-checksum-skipped", "the joined onnxruntime-gpu wheel is installed unchecked", [
        ("tests/gpu_check.sh", 'if ! (cd "$PARTS" && sha256sum --check --status SHA256SUMS); then', "if false; then"),
    ], GPU_CHECK_TESTS),
    Mutant("gpu-check-site-not-on-path", "the carried onnxruntime-gpu is installed but not put on PYTHONPATH (the "
           "CPU build runs)", [
        ("tests/gpu_check.sh", 'export PYTHONPATH="$SITE:$PYTHONPATH"', "true"),
    ], GPU_CHECK_TESTS),
    Mutant("bench-gpu-floor-scales-not-copied", "the GPU floor copies the MXFP4 codes but not their scales", [
        ("def mxfp4_bytes", 'name.endswith(("_blocks", "_scales"))', 'name.endswith("_blocks")'),
    ], ["tests/project/test_bench_calibrate_gpu.py"]),
    Mutant("bench-gpu-floor-smaller-binds", "the GPU floor takes the smaller of the copy and the matmuls", [
        ("def gpu_floor", "    if h2d_s >= bf16_matmul_s:", "    if h2d_s <= bf16_matmul_s:"),
    ], ["tests/project/test_bench_calibrate_gpu.py"]),
    Mutant("qmoe-check-schema-not-repacked", "the QMoE check hands the kernel a schema-layout weight as it is", [
        ("tests/qmoe_cuda_check.py", "            packed = qmoe_layout.schema_to_kernel(packed, rows, k)\n", ""),
    ], ["tests/onnx/test_qmoe_cuda.py"]),
    Mutant("gpu-check-no-preload", "the carried onnxruntime-gpu is imported without preload_dlls()", [
        ("tests/gpu_check.sh", "ort.preload_dlls()  # the CUDA", "pass  # the CUDA"),
    ], GPU_CHECK_TESTS),
    Mutant("gpu-check-skips-counted-as-passes", "the summary counts a skipped test as passed", [
        ("tests/gpu_check_summary.py", 'elif case.find("skipped") is not None:', "elif False:"),
    ], GPU_CHECK_TESTS),
    # -- checkpoint diff ---------------------------------------------------------------------------------
    Mutant("diff-act-step-times-g", "the activation fake-quant's step is s * g instead of s / g", [
        ("def fake_quantize_activation", "    step = s / g\n", "    step = s * g\n"),
    ], DIFF_TESTS),
    Mutant("diff-weight-conventions-swapped", "a multiplier global scale divides and a divisor multiplies", [
        ("fp4pass/checkpoint/nvfp4_weights.py", "(s * g if convention == MULTIPLIER else s / g)", "(s / g if convention == MULTIPLIER else s * g)"),
    ], DIFF_ORACLE_TESTS),
    Mutant("diff-stack-one-scale", "a gpt-oss stack decodes every expert with expert 0's global scale", [
        ("def NVExpertStack.fill_stack", "scale[i].to(out.device), MULTIPLIER,", "scale[0].to(out.device), MULTIPLIER,"),
    ], DIFF_ORACLE_TESTS),
    Mutant("diff-stack-untransposed", "a gpt-oss stack's experts are decoded into the model untransposed", [
        ("def NVExpertStack.fill_stack", "target = out[i].t() if transposed else out[i]", "target = out[i]"),
    ], DIFF_ORACLE_TESTS),
    Mutant("diff-gate-up-takes-w3", "a fused gate/up input is quantized with w3's input scale, not w1's", [
        ("def _Quantizer.__init__", 'for k in ("w1", "gate_proj") if k in halves', 'for k in ("w3", "up_proj") if k in halves'),
    ], DIFF_TESTS),
    Mutant("diff-padding-counted", "the experts' rows keep the padding's tokens", [
        ("def _ExpertRows.keep", "return rows if self.valid is None else rows[self.valid[token_idx]]",
         "return rows"),
    ], DIFF_TESTS),
    Mutant("diff-end-to-end-is-local", "the NVFP4 model is never fed its own previous output", [
        ("def _nvfp4_runs", "out = nv.run_layer(module, torch.cat([h_local, h_own]), args, kwargs)",
         "out = nv.run_layer(module, torch.cat([h_local, h_local]), args, kwargs)"),
    ], DIFF_ORACLE_TESTS),
    Mutant("diff-best-expert-first", "the expert list sorted best first", [
        ("def _worst_first", 'return math.inf if row["snr_db"] is None else row["snr_db"]',
         'return -math.inf if row["snr_db"] is None else -row["snr_db"]'),
    ], DIFF_TESTS),
    Mutant("diff-first-position-scored", "perplexity scores each token as its own next token", [
        ("def next_tokens", "out[:, :-1] = ids[:, 1:]", "out[:, :-1] = ids[:, :-1]"),
    ], DIFF_ORACLE_TESTS),
    Mutant("diff-kl-reversed", "KL(nvfp4 || source) instead of KL(source || nvfp4)", [
        ("def LogitStats.add", "kl = (log_p.exp() * (log_p - log_q)).sum(-1)", "kl = (log_q.exp() * (log_q - log_p)).sum(-1)"),
    ], DIFF_TESTS),
    Mutant("diff-one-expert-scale", "every expert of a per-expert stack takes expert 0's activation scale", [
        ("def _Quantizer.scale", "                g = g[expert]\n", "                g = g[0]\n"),
    ], DIFF_ORACLE_TESTS),
    # -- the checkpoint diff's report, its checks before the run, its plot -----------------------------------
    Mutant("diff-json-worst-only", "diff --json keeps only the worst experts", [
        ("def CheckpointDiff.to_json", '"experts": [row(r) for r in self.experts],',
         '"experts": [row(r) for r in self.worst_experts()],'),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-no-ppl-formatted", "a perplexity of None (--seq-len 1) formatted as a number", [
        ("fp4pass/checkpoint/diff_report.py", 'return "n/a" if value is None else f"{value:.4g}"', 'return f"{value:.4g}"'),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-kl-max-inclusive", "a KL mean equal to --kl-max fails", [
        ("def CheckpointDiff._limit_failures", "(not finite_kl or kl > self.kl_max)", "(not finite_kl or kl >= self.kl_max)"),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-snr-min-inclusive", "a local SNR equal to --snr-min fails", [
        ("def CheckpointDiff.first_below", "if snr is not None and snr < self.snr_min:",
         "if snr is not None and snr <= self.snr_min:"),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-failed-value-threshold-swapped", "the failed SNR entry gives the threshold as the value", [
        ("def CheckpointDiff._limit_failures", '_json_db(row["snr_db_local"]), self.snr_min))',
         'self.snr_min, _json_db(row["snr_db_local"])))'),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-failed-line-no-where", "a FAILED line without the checkpoint module", [
        ("def CheckpointDiff.format_table", """at = f"layer {f['layer']} ({f['where']})" if""", """at = f"layer {f['layer']}" if"""),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-nonfinite-outputs-pass", "NaN/Inf in a layer's output is no failure", [
        ("def CheckpointDiff._nonfinite_failures",
         'bad = next((r for r in self.layers if r.get("nonfinite_local") or r.get("nonfinite_end_to_end")), None)',
         "bad = None"),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-expert-named-by-model", "an expert named by the model's stack, not its checkpoint module", [
        ("def _layer_rows", '"checkpoint_module": names.expert(prefix + rel, e)}',
         '"checkpoint_module": prefix + rel}'),
    ], DIFF_CHECKS_TESTS),
    Mutant("diff-expert-name-one-part-short", "an expert's checkpoint module keeps its part (w1)", [
        ("def CheckpointNames.expert", "return self._strip(name, 2)  # ...experts.<e>.w1.weight",
         "return self._strip(name, 1)  # ...experts.<e>.w1.weight"),
    ], DIFF_CHECKS_TESTS),
    Mutant("diff-layer-named-by-model", "a layer named by the model's path (layers.0), not the checkpoint's", [
        ("def CheckpointNames.module", "                return self._strip(name, tail)\n", "                return path\n"),
    ], DIFF_CHECKS_TESTS),
    Mutant("diff-nvfp4-shapes-unchecked", "the NVFP4 side's headers are not checked against the model", [
        ("fp4pass/checkpoint/numerics.py", "        check_stored_shapes(target, weights, *target_arch)\n", ""),
    ], DIFF_CHECKS_TESTS),
    Mutant("diff-stack-block-unchecked", "a gpt-oss stack's block scales are not checked against its codes", [
        ("def _check_stack",
         '    _check(unit.block, (e, k // NV_BLOCK_SIZE, n), f"{what}: block scales [E, K/16, N] of [{e}, {n}, {k}]")\n',
         ""),
    ], DIFF_CHECKS_TESTS),
    Mutant("diff-scale-count-unchecked", "a global or input scale of any size is accepted", [
        ("def _check_scale", "if entry is not None and math.prod(_shape(entry)) not in counts:",
         "if False:"),
    ], DIFF_CHECKS_TESTS),
    Mutant("diff-plain-size-only", "a tensor read as it is only needs as many values as the model", [
        ("def _check_plain",
         "if held != shape and not (math.prod(held) == math.prod(shape) and len(held) <= 1 and len(shape) <= 1):",
         "if math.prod(held) < math.prod(shape):"),
    ], DIFF_CHECKS_TESTS),
    Mutant("diff-infinite-scale-passes", "only NaN scales count, Inf ones pass", [
        ("def nonfinite_scales", "if not torch.isfinite(values).all():", "if torch.isnan(values).any():"),
    ], DIFF_CHECKS_TESTS),
    Mutant("diff-nonfinite-last-module", "the last module whose output holds NaN/Inf is named, not the first", [
        ("def _NonfiniteWatch.first", "return next((name for name in self.order if bool(self.flags[name])), None)",
         "return next((name for name in reversed(self.order) if bool(self.flags[name])), None)"),
    ], DIFF_CHECKS_TESTS),
    Mutant("diff-model-named-by-snapshot", "a Hub model's name is its cache snapshot's commit folder", [
        ("def _model_name", 'if len(parts) >= 3 and parts[-2] == "snapshots" and', "if False and"),
    ], DIFF_TESTS),
    Mutant("diff-plot-legend-inside", "the plot's legend inside the axes, at the lower left", [
        ("def plot_checkpoint_diff",
         'ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)',
         'ax.legend(fontsize=7, loc="lower left")'),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-plot-fractional-ticks", "the layer axis ticks where matplotlib likes (0.5, 1.5...)", [
        ("def plot_checkpoint_diff", "        ax.set_xticks(range(n))\n", "        pass\n"),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-plot-identical-unlabelled", "identical layers drawn at the top without a legend entry", [
        ("def plot_checkpoint_diff", '("identical", "*", "green", "identical (no error; drawn at the top)")',
         '("identical", "*", "green", None)'),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-plot-80-db-top", "identical layers drawn at the 80 dB cap, whatever the SNRs drawn", [
        ("def bounds", "top = min(cap, 5 * math.ceil((max(shown) + 10) / 5)) if shown else cap",
         "top = cap"),
    ], DIFF_REPORT_TESTS),
    Mutant("diff-plot-title-model-type", "the plot's title is transformers' model type alone", [
        ("def _title", 'return f"{model_label(run)}: NVFP4', 'return f"{run[\'model_type\']}: NVFP4'),
    ], DIFF_REPORT_TESTS),
    # -- the checkpoint facts in their records: forms, engine records, problem kinds -------------------------
    Mutant("records-suffix-spelled-in-validator", "the validator names an input scale by its suffix, not its form", [
        ("def _input_name", '    return mod.form.tensor(mod.name, "input_scale")',
         '    return f"{mod.name}.input_scale" if mod.convention == MULTIPLIER else mod.form.tensor(mod.name, '
         '"input_scale")'),
    ], ["tests/project/test_records_spelled_once.py"]),
    Mutant("records-engine-named-in-verdicts", "a verdict branches on an engine's name, not on its record", [
        ("def _modelopt_verdict", "        if not engine_record(engine).mixed_precision:",
         '        if engine != "vllm":'),
    ], ["tests/project/test_records_spelled_once.py"]),
    Mutant("engine-record-outcome-ignored", "an engine's own outcome of a problem kind ignored (TensorRT-LLM's "
           "refusal of a w1/w3 mismatch)", [
        ("def Problem.outcome_for", "self.outcome or engine_record(engine).outcomes.get(self.kind) or ",
         "self.outcome or "),
    ], VALIDATE_TRUST_TESTS),
    Mutant("engine-record-fused-ignored", "SGLang's fallback fused modules ignored: the family's taken", [
        ("def Engine.fused_modules",
         "        return dict(family_of(architecture).vllm_fused) if self.fused is None else dict(self.fused)",
         "        return dict(family_of(architecture).vllm_fused)"),
    ], ["tests/checkpoint/test_checkpoint_engines.py"]),
    Mutant("engine-held-to-every-form", "every engine held to every form (TensorRT-LLM to compressed-tensors)", [
        ("def engines_held_to", "if cfg.form not in e.not_held_to and e.name in claimed]",
         "if e.name in claimed]"),
    ], VALIDATE_TRUST_TESTS),
    # -- the NVFP4 validator: no false alarm on a correct checkpoint, every defect still exit 1 -------------
    Mutant("validate-pair-judged-alone", "w3's global scale judged without w1, whose amax it was made from", [
        ("def validation",
         'check_values(mod, problems, modules.get(partner_name(mod.name) or ""))',
         "check_values(mod, problems, None)"),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-sample-only", "magnitude findings from the block-scale sample, never from the whole tensor", [
        ("def validation", "        read_exact_blocks(data, modules)\n", ""),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-sample-short-of-the-end", "the last sampled piece stops short of the tensor's last bytes", [
        ("def _sample_pieces", "    last = nbytes - piece\n",
         "    last = (nbytes - piece) // (_PIECES - 1) * (_PIECES - 1)\n"),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-folded-by-magnitude", "a global scale of 1 over small block scales is folded, lossy or not", [
        ("def _check_weight_magnitude", " & (maxima <= FOLDED_BLOCK_MAX) & (lossy > 0)",
         " & (maxima <= FOLDED_BLOCK_MAX)"),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-guess-fails", "a magnitude guess fails inspect like an error", [
        ("def Problem.__post_init__",
         "self.warning = self.warning or self.guess", "self.warning = self.warning"),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-engine-gap-fails", "an engine that does not load a correct form fails inspect without --engine", [
        ("def validation", "warning=engine is None))", "warning=False))"),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-strict-ignored", "--strict does not count the warnings", [
        ("def exit_status", "any(strict or p.get(", "any(p.get("),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-table-loads-anyway", "the engine table says loads beside problems that break the engine", [
        ("def settle_verdicts", '        if worst != "loads" and verdict.get("loads"):',
         "        if False:"),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-numpy-repr", "a bad scale's value shown as numpy's repr (np.float64(0.0))", [
        ("def _value_problems", "({_number(values[mask][0])}); {effect}",
         "({values[mask][0]!r}); {effect}"),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-cannot-load-without-fix", "engine_cannot_load names no fix", [
        ("def validation", "{verdict.get('why') or 'cannot load this form'}; fix: \"\n"
         "                                        f\"{cannot_load_fix(name, cfg, data.config, modules)}\"",
         "{verdict.get('why') or 'cannot load this form'}\""),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-stack-one-max", "a stack's experts judged by the stack's largest block scale, not their own", [
        ("def _read_block_census",
         "    experts = experts if experts > 1 and entry.nbytes % experts == 0 else 1\n",
         "    experts = 1\n"),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-input-guess-certain", "an activation amax above 2^16 (an outlier) is called a swapped scale", [
        ("def _check_input_magnitude", "certain = as_stored > OWN_WEIGHT_AMAX_RANGE[1]", "certain = True"),
    ], VALIDATE_TRUST_TESTS),
    Mutant("validate-table-no-convention", "the table's global scale column does not say multiplier or divisor", [
        ("def _module_lines.scale",
         "return f\"{number} {m.get('convention', '')}\".rstrip()", "return number"),
    ], VALIDATE_TRUST_TESTS),
    Mutant("checkpoint-inspect-nvfp4-as-mxfp4", "fp4pass.checkpoint.inspect: an NVFP4 folder's empty MXFP4 forecast", [
        ("fp4pass/checkpoint/inspection.py",
         "    if is_nvfp4_folder(src_dir, follow_symlinks=follow_symlinks):\n        return validate(",
         "    if False:\n        return validate("),
    ], VALIDATE_TRUST_TESTS),
    # -- diff/--check on KV caches: a present of its past's shape runs in a copy of the past ----------------------
    Mutant("kv-present-uninitialised", "a ring-buffer present left to onnxruntime's allocator (rows unwritten)", [
        ("def _Runner._run_feeds", "        if not self.past_buffers:\n            return session.run(",
         "        if True:\n            return session.run("),
    ], ["tests/campaigns/test_check_inputs.py"]),
    Mutant("kv-present-past-slot", "the past/present pairs read from the wrong GroupQueryAttention slots", [
        ("fp4pass/onnx/feeds.py", '_PAST_PRESENT = {"GroupQueryAttention": ((3, 1), (4, 2))',
         '_PAST_PRESENT = {"GroupQueryAttention": ((3, 2), (4, 1))'),
    ], ["tests/campaigns/test_check_inputs.py"]),
]


def _copy_repo(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".git", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info", ".venv",
                                    "build", "dist")
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)


def _definitions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` of every function and class of a module, nested ones as ``Outer.inner``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            yield name, node
            yield from _definitions(node, name + ".")


def definitions(root: Path) -> dict[str, list[tuple[Path, int, int]]]:
    """Qualified name -> ``(file, start, end)`` character offsets of each function and class of the package
    (decorators included), for :func:`locate`."""
    found: dict[str, list[tuple[Path, int, int]]] = {}
    for path in sorted((root / "fp4pass").rglob("*.py")):
        text = path.read_text()
        starts = [0]
        for line in text.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))
        for qualname, node in _definitions(ast.parse(text)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found.setdefault(qualname, []).append((path, starts[first - 1], starts[node.end_lineno]))
    return found


def locate(root: Path, where: str, index: dict | None = None) -> tuple[Path, int, int] | str:
    """Where an edit applies: ``(file, start, end)`` character offsets in it, or why it cannot be found.

    ``where`` is a path relative to the repository (the whole file), or ``def NAME`` (``def Class.method``):
    the one function or class of that qualified name anywhere in the package, so that the mutant follows the
    code when it moves between modules; two definitions of the name are an error (make the name longer).
    ``index``: :func:`definitions` of ``root``, when many edits are located in files that do not change."""
    if not where.startswith("def "):
        path = root / where
        return (path, 0, len(path.read_text())) if path.is_file() else f"{where}: no such file"
    name = where[len("def "):]
    found = (definitions(root) if index is None else index).get(name, [])
    if len(found) != 1:
        return f"{where}: {len(found)} definitions of {name} in fp4pass/"
    return found[0]


def _apply(copy: Path, mutant: Mutant) -> str | None:
    """Apply the edits in ``copy``; returns why not, or None when every edit applied. Each old text is replaced
    wherever it occurs in its file, or in its definition (:func:`locate`)."""
    for where, old, new in mutant.edits:
        place = locate(copy, where)
        if isinstance(place, str):
            return place
        path, start, end = place
        text = path.read_text()
        if old not in text[start:end]:
            return f"{where}: text not found: {old!r}"
        path.write_text(text[:start] + text[start:end].replace(old, new) + text[end:])
    missing = [t for t in mutant.tests if not (copy / t).exists()]
    if missing:
        return f"its test file {missing[0]} is gone (update the mutant's tests)"
    return None


def _pytest(copy: Path, tmp: str, tests: list[str]) -> subprocess.CompletedProcess:
    """pytest in ``copy``: a fresh hypothesis example database under ``tmp`` (through TMPDIR, which the
    conftest's database folder follows) and a fixed hypothesis seed, so that every run sees the same examples
    and no failure found by one mutant is replayed in another."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", TMPDIR=tmp)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--hypothesis-seed=0",
           "--basetemp", str(Path(tmp) / "pytest"), *tests]
    return subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)


def _summary(proc: subprocess.CompletedProcess) -> tuple[list[str], str]:
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    failed = [line for line in tail if line.startswith(("FAILED", "ERROR"))]
    return tail, (failed[0] if failed else (tail[-1] if tail else ""))[:160]


def run_baseline(tests: list[str]) -> tuple[bool, str]:
    """The tests of the chosen mutants on an unmutated copy: a mutant is killed only if these pass."""
    with tempfile.TemporaryDirectory(prefix="fp4pass-mutant-baseline-") as tmp:
        copy = Path(tmp) / "repo"
        _copy_repo(copy)
        proc = _pytest(copy, tmp, [t for t in tests if (copy / t).exists()])
        return proc.returncode == 0, _summary(proc)[1]


def run_mutant(mutant: Mutant, all_tests: bool, verbose: bool) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix=f"fp4pass-mutant-{mutant.name}-") as tmp:
        copy = Path(tmp) / "repo"
        _copy_repo(copy)
        why = _apply(copy, mutant)
        if why is not None:
            return "could not apply", why
        tests = [] if all_tests else list(mutant.tests)
        proc = _pytest(copy, tmp, tests)
        tail, detail = _summary(proc)
        if verbose:
            print("\n".join(tail[-30:]))
        if proc.returncode == 0:
            return "SURVIVED", detail
        if proc.returncode == 1:
            return "killed", detail
        return "killed (error)", f"pytest exit {proc.returncode}: {detail}"


def default_jobs() -> int:
    """One mutant per core this process may run on (its CPU affinity, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of jobs")
    return value


def run_all(chosen: list[Mutant], all_tests: bool, verbose: bool, jobs: int, report) -> dict[str, str]:
    """Run ``chosen``, ``jobs`` at a time; ``report(line)`` gets one ``[n/N]`` line as each finishes. Returns
    each mutant's outcome by name."""
    outcomes: dict[str, str] = {}

    def one(m: Mutant) -> tuple[Mutant, str, str, float]:
        start = time.perf_counter()
        outcome, detail = run_mutant(m, all_tests, verbose)
        if outcome == "SURVIVED" and m.open_question:
            outcome = "survived (open)"
        return m, outcome, detail, time.perf_counter() - start

    width = len(str(len(chosen)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, m) for m in chosen]
        for n, future in enumerate(concurrent.futures.as_completed(futures), 1):
            m, outcome, detail, seconds = future.result()
            outcomes[m.name] = outcome
            report(f"[{n:>{width}}/{len(chosen)}] {outcome:<16} {m.name:<40} {seconds:6.1f}s  {detail}")
    return {m.name: outcomes[m.name] for m in chosen}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--all-tests", action="store_true", help="run the whole default suite for each mutant")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    parser.add_argument("-j", "--jobs", type=_positive, default=None, metavar="N",
                        help=f"mutants run at a time, each in its own copy (default: {default_jobs()}, one per core)")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutant(s): {', '.join(unknown)}; see --list")
    chosen = [known[n] for n in args.names] if args.names else MUTANTS
    if args.list:
        for m in chosen:
            print(f"{m.name:<40} {m.what}\n{'':<40} tests: {' '.join(m.tests)}")
        return 0
    t0 = start = time.perf_counter()
    tests = [] if args.all_tests else sorted({t for m in chosen for t in m.tests})
    passed, detail = run_baseline(tests)
    print(f"{'baseline ' + ('passed' if passed else 'FAILED'):<16} {'(no mutation)':<40} "
          f"{time.perf_counter() - start:6.1f}s  {detail}", flush=True)
    if not passed:
        print("the tests fail without any mutation: no mutant can be judged")
        return 2
    jobs = args.jobs or default_jobs()
    print(f"{len(chosen)} mutants, {jobs} at a time", flush=True)
    outcomes = run_all(chosen, args.all_tests, args.verbose, jobs, lambda line: print(line, flush=True))
    survived = [n for n, o in outcomes.items() if o == "SURVIVED"]
    unapplied = [n for n, o in outcomes.items() if o == "could not apply"]
    open_ = [n for n, o in outcomes.items() if o == "survived (open)"]
    killed = len(outcomes) - len(survived) - len(unapplied) - len(open_)
    print(f"\n{killed} killed, {len(survived)} survived, {len(unapplied)} could not apply, {len(open_)} survived "
          f"with no killing input known, of {len(outcomes)} ({time.perf_counter() - t0:.0f} s)")
    for n in open_:
        print(f"  open: {n}: {known[n].note}")
    if survived:
        print("survivors: " + ", ".join(survived))
        for n in survived:
            if known[n].note:
                print(f"  {n}: {known[n].note}")
    if unapplied:
        print("could not apply: " + ", ".join(unapplied))
    return 1 if survived or unapplied else 0


if __name__ == "__main__":
    sys.exit(main())
