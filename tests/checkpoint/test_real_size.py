"""The memory probes of ``python -m fp4pass.examples.real_size``, against readers we did not write."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from fp4pass.examples import real_size

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_rss_in_gib_matches_statm():
    """VmRSS in GiB against /proc/self/statm's resident pages times the page size (another kernel view)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    statm = pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    assert real_size._status_gib("VmRSS") == pytest.approx(statm, rel=0.1)
    with pytest.raises(RuntimeError, match="NoSuchKey"):
        real_size._status_gib("NoSuchKey")


@pytest.mark.skipif(shutil.which("free") is None, reason="procps' free is not installed")
def test_memory_in_use_matches_free():
    """MemTotal - MemAvailable in GiB against procps' ``free -b`` (total minus available)."""
    before = real_size._in_use_gib()
    fields = subprocess.run(["free", "-b"], capture_output=True, text=True, check=True).stdout.splitlines()[1].split()
    after = real_size._in_use_gib()
    total, available = int(fields[1]), int(fields[6])
    # other work may take or free memory between the reads: free's figure lies within ours, taken around it
    assert min(before, after) - 0.05 <= (total - available) / 2**30 <= max(before, after) + 0.05
    assert 0 < before < total / 2**30


def test_sampler_sees_memory_taken_while_it_runs():
    """The highest value while the block runs: 512 MiB taken (and touched) inside it shows, and is gone after.
    Sampled on this process's own RSS, so that other work on the machine cannot hide it or add to it."""
    rss = lambda: real_size._status_gib("VmRSS")  # noqa: E731
    with real_size._Sampler(period=0.02, probe=rss) as sampler:
        start = sampler.high
        block = np.ones(512 * 2**20, dtype=np.uint8)
        time.sleep(0.3)
        del block
    assert 0.45 < sampler.high - start < 0.6
    assert rss() - start < 0.25  # the block was freed: the high mark is the sampler's, not what is left


def test_sampler_reads_the_machines_memory_by_default():
    assert real_size._Sampler().probe is real_size._in_use_gib


def test_a_folder_that_does_not_fit_is_one_line_and_exit_2(tmp_path, capsys):
    """A checkpoint folder with fewer layers than asked for: one error line naming it, exit 2, no traceback."""
    from fp4pass.examples.gpt_oss_tiny import build_sized_gpt_oss

    small = {"num_hidden_layers": 1, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
             "num_local_experts": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    folder = build_sized_gpt_oss(tmp_path / "m", small)
    assert real_size.main([str(folder), "--layers", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_hidden_layers" in err[0] and str(folder) in err[0] and "Traceback" not in err[0]


def test_a_json_output_that_is_a_fifo_is_refused_before_the_run(tmp_path, capsys):
    """``--json`` naming a FIFO: one error line and exit 2 before anything is built or run."""
    fifo = tmp_path / "figures.json"
    os.mkfifo(fifo)
    assert real_size.main([str(tmp_path / "m"), "--layers", "1", "--json", str(fifo)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "figures.json" in err[0]
    assert not (tmp_path / "m").exists()
