"""``benchmark/gpu/bg.sh``, the runner of GPU stages longer than one device call, on a stand-in
``run_all.sh`` (no GPU): ``start`` runs the stages from a snapshot of the checkout in their own
session and returns after ``BG_WAIT`` seconds; a second ``start`` while they run is refused;
``wait`` waits again and copies everything so far to ``$OUT``; a new ``start`` keeps the previous
results in ``$BG_DIR.prev``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# each stage waits for a file named after it in $GATE (so the test decides when the run ends, with
# no timing assumption), then writes its result into $OUT as run_all.sh's stages do
STAND_IN = """#!/usr/bin/env bash
for stage in "$@"; do
  while [ ! -e "$GATE/$stage" ]; do sleep 0.1; done
  echo "{VERSION} $stage" > "$OUT/$stage.txt"
  echo "stage $stage done"
done
"""


def checkout(tmp_path: Path, version: str) -> Path:
    repo = tmp_path / "repo"
    (repo / "benchmark" / "gpu").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "benchmark" / "gpu" / "bg.sh", repo / "benchmark" / "gpu" / "bg.sh")
    (repo / "benchmark" / "gpu" / "run_all.sh").write_text(STAND_IN.replace("{VERSION}", version))
    return repo


def bg(repo: Path, env: dict, *args: str, wait: int) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "benchmark" / "gpu" / "bg.sh"), *args], cwd=repo,
                          env=dict(env, BG_WAIT=str(wait)), capture_output=True, text=True, timeout=120)


def test_bg_runs_stages_from_a_snapshot_across_calls(tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    try:
        run_and_check(tmp_path, gate)
    finally:  # a failed check leaves no stand-in stage waiting in the background
        for stage in "abc":
            (gate / stage).touch()


def run_and_check(tmp_path: Path, gate: Path) -> None:
    repo = checkout(tmp_path, "v1")
    bg_dir = tmp_path / "bg"
    env = dict(os.environ, GATE=str(gate), BG_DIR=str(bg_dir), OUT=str(tmp_path / "out1"))

    assert bg(repo, env, "wait", wait=1).returncode == 1  # nothing started here yet
    first = bg(repo, env, "start", "a", "b", wait=1)
    assert first.returncode == 0 and "started: a b" in first.stdout and "--- still running" in first.stdout
    again = bg(repo, env, "start", "c", wait=1)
    assert again.returncode == 1 and "still going" in again.stderr

    checkout(tmp_path, "v2")  # an edit after start: the run keeps the code it started with
    (gate / "a").touch()
    (gate / "b").touch()
    env["OUT"] = str(tmp_path / "out2")
    done = bg(repo, env, "wait", wait=60)
    assert done.returncode == 0 and "--- ended" in done.stdout, done.stdout + done.stderr
    out = tmp_path / "out2"
    assert (out / "a.txt").read_text() == "v1 a\n" and (out / "b.txt").read_text() == "v1 b\n"
    assert "=== all stages ended rc=0" in (out / "log").read_text()
    assert (out / "commit").exists() and not (out / "src").exists()  # the snapshot stays on the machine
    assert not (out / "pid").exists()  # a call returns at most 8 files

    (gate / "c").touch()
    env["OUT"] = str(tmp_path / "out3")
    third = bg(repo, env, "start", "c", wait=60)
    assert third.returncode == 0 and "--- ended" in third.stdout
    assert (tmp_path / "out3" / "c.txt").read_text() == "v2 c\n"
    assert not (tmp_path / "out3" / "a.txt").exists()
    assert (Path(str(bg_dir) + ".prev") / "a.txt").read_text() == "v1 a\n"  # the previous run's results


def test_small_card_runs_its_own_stages(tmp_path):
    """``BG_SMALL_STAGES``: on a card under 100 GB (an H100 where an H200 was asked for) the
    stages named there run instead; on a larger card, or with no GPU, the ones given."""
    gate = tmp_path / "gate"
    gate.mkdir()
    for stage in "abc":
        (gate / stage).touch()
    repo = checkout(tmp_path, "v1")
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    for mib, ran in (("81559", "c"), ("143771", "a")):
        smi.write_text(f"#!/usr/bin/env bash\necho {mib}\n")
        smi.chmod(0o755)
        out = tmp_path / f"out{mib}"
        env = dict(os.environ, GATE=str(gate), BG_DIR=str(tmp_path / f"bg{mib}"), OUT=str(out),
                   PATH=f"{fake}:{os.environ['PATH']}", BG_SMALL_STAGES="c")
        res = bg(repo, env, "start", "a", wait=60)
        assert res.returncode == 0 and "--- ended" in res.stdout, res.stdout + res.stderr
        assert sorted(p.name for p in out.glob("?.txt")) == [f"{ran}.txt"]


def cache_script(tmp_path: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "repo" / "benchmark" / "gpu" / "compile_cache.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "benchmark" / "gpu" / "compile_cache.sh", script)
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=120)


def test_compile_cache_round_trip_and_size_cap(tmp_path):
    """``compile_cache.sh save`` packs the cache folder into one returnable file (or, over the cap,
    writes nothing and says so); ``restore`` unpacks the carried file once per machine."""
    made = tmp_path / "made"
    (made / "inductor" / "fxgraph").mkdir(parents=True)
    (made / "inductor" / "fxgraph" / "entry").write_bytes(os.urandom(3 << 20))  # incompressible 3 MiB
    (made / "triton" / "k.cubin").parent.mkdir()
    (made / "triton" / "k.cubin").write_text("kernel")
    out = tmp_path / "out"
    env = dict(os.environ, SPARSE_CACHE_DIR=str(made), XZ_OPT="-0")  # fast: the data is random

    capped = cache_script(tmp_path, dict(env, COMPILE_CACHE_MAX_MB="2"), "save", str(out))
    assert capped.returncode == 0 and "over 2 MiB, not saved" in capped.stdout, capped.stdout + capped.stderr
    assert not list(out.iterdir())  # no partial file comes back

    saved = cache_script(tmp_path, env, "save", str(out))
    assert saved.returncode == 0 and "packed into" in saved.stdout, saved.stdout + saved.stderr
    assert [p.name for p in out.iterdir()] == ["compile_cache.tar.xz"]

    fresh = tmp_path / "fresh"  # the next machine: the file carried as .gpucache/
    (tmp_path / "repo" / ".gpucache").mkdir()
    shutil.copy(out / "compile_cache.tar.xz", tmp_path / "repo" / ".gpucache" / "compile_cache.tar.xz")
    env = dict(os.environ, SPARSE_CACHE_DIR=str(fresh))
    first = cache_script(tmp_path, env, "restore")
    assert first.returncode == 0 and "restored" in first.stdout, first.stdout + first.stderr
    assert (fresh / "inductor" / "fxgraph" / "entry").read_bytes() == (made / "inductor" / "fxgraph" / "entry").read_bytes()
    assert (fresh / "triton" / "k.cubin").read_text() == "kernel"
    (fresh / "triton" / "k.cubin").write_text("rebuilt here")  # a later sourcing of env.sh keeps it
    again = cache_script(tmp_path, env, "restore")
    assert again.returncode == 0 and again.stdout == "" and (fresh / "triton" / "k.cubin").read_text() == "rebuilt here"
    assert cache_script(tmp_path, env, "bogus").returncode == 2


def test_commit_file_names_the_tree_that_ran(tmp_path):
    """The device machine's .git can lag the files sent with a call, so ``commit`` also holds the
    tree hash of the files as they were at ``start``: the one of the commit made of them later."""
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "a").touch()
    repo = checkout(tmp_path, "v1")
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo,  # noqa: E731
                                    check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "v1")
    checkout(tmp_path, "v2")  # edited, not committed: HEAD still says v1
    env = dict(os.environ, GATE=str(gate), BG_DIR=str(tmp_path / "bg"), OUT=str(tmp_path / "out"))
    assert bg(repo, env, "start", "a", wait=60).returncode == 0
    head, tree = (tmp_path / "out" / "commit").read_text().split("\n")[:2]
    assert head == git("rev-parse", "HEAD")
    git("add", "-A")
    git("commit", "-qm", "v2")
    assert tree == "tree " + git("rev-parse", "HEAD^{tree}") != "tree " + git("rev-parse", "HEAD~1^{tree}")
    assert git("status", "--porcelain") == ""  # the runner's own index left the repo's alone
