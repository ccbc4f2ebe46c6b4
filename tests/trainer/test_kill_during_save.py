"""Issue 7: an atomic checkpoint survives a real SIGKILL of the whole job *during* a save.

A real 2-rank ``torchrun ... cli train`` run writes complete checkpoints at steps 1 and 2; during the
save of step 3 (actor written, critic / optimizer / trainer state not yet) every rank pauses through the
``S3AC_TESTING_SAVE_PAUSE`` hook (``megatron_s3ac.faults``), and the test SIGKILLs torchrun's process
group and each rank's (torch elastic gives every worker its own session). Then: the latest checkpoint
is step 2, the stale ``step_000003.tmp`` is removed by the next save (none of its files reach the
published dir), the resumed run finishes, and its metrics equal an uninterrupted run's with the same
seed; no process of any run survives.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_s3ac.trainer.run.checkpoint import latest_checkpoint
from tests.trainer.test_trainer import ROOT, SMALL, _metrics

COMMON = SMALL + ["actor_layout.ep=2", "train.steps=4", "train.save_every=1", "train.keep_last=2",
                  "train.eval_every=0"]
KILL_STEP = 3  # the save interrupted; steps 1 and 2 are complete on disk by then
RUN_TIMEOUT = 300


def _procs() -> dict[int, tuple[str, int, int, int]]:
    """pid -> (state, ppid, pgid, sid) of every process."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        st, ppid, pgid, sid = stat[stat.rindex(")") + 2:].split()[:4]
        out[int(p)] = (st, int(ppid), int(pgid), int(sid))
    return out


class Job:
    """A ``torchrun ... cli train`` run in its own session. torch elastic starts every worker with
    ``start_new_session=True``, so killing torchrun's process group alone would leave the ranks running
    as orphans: the job's groups are torchrun's plus each worker's (tracked while it runs), and the
    kill sends SIGKILL to all of them."""

    def __init__(self, out, log, env_extra=None):
        env = {k: v for k, v in os.environ.items() if k != "S3AC_TESTING_SAVE_PAUSE"}
        env.update(OMP_NUM_THREADS="1", **(env_extra or {}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "megatron_s3ac.trainer.cli", "train"] + COMMON + [f"train.out_dir={out}"]
        self.log = log
        # a log file, not a pipe: a helper process that outlived a rank would keep a pipe open
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.groups = {self.proc.pid}  # pgids / sids that belong to this job

    def track(self) -> None:
        """Add the process groups of every live descendant of torchrun (the ranks' own sessions)."""
        procs, tree, todo = _procs(), set(), [self.proc.pid]
        children = {}
        for pid, (_, ppid, _, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        while todo:
            for c in children.get(todo.pop(), []):
                if c not in tree:
                    tree.add(c)
                    todo.append(c)
        self.groups |= {procs[p][2] for p in tree} | {procs[p][3] for p in tree}

    def survivors(self) -> list[int]:
        return [pid for pid, (st, _, pgid, sid) in _procs().items()
                if st != "Z" and (pgid in self.groups or sid in self.groups)]

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (rc := self.proc.poll()) is None:
            assert time.monotonic() < deadline, f"run did not finish in {timeout} s"
            self.track()
            time.sleep(0.2)
        return rc

    def kill(self) -> None:
        """SIGKILL every process group of the job at once (torchrun's and each rank's)."""
        self.track()
        for g in self.groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def reap(self) -> list[int]:
        """Kill whatever is left of the job; return the pids that had survived until now."""
        left = self.survivors()
        self.kill()
        for pid in self.survivors():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        return left

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()


def _run_to_end(out, log):
    job = Job(out, log)
    try:
        rc = job.wait(RUN_TIMEOUT)
        time.sleep(0.5)
    finally:
        left = job.reap()
    assert rc == 0, job.output()[-3000:]
    assert not left, f"processes outlived a finished run: {left}"
    return job.output()


@pytest.mark.slow
def test_sigkill_during_save_keeps_previous_checkpoint_and_resume_matches(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ck = b / "checkpoints"
    tmp_dir = ck / f"step_{KILL_STEP:06d}.tmp"
    markers = [tmp_dir / f"PAUSED_rank{r}" for r in range(2)]

    t0 = time.monotonic()
    _run_to_end(a, tmp_path / "a.log")  # uninterrupted reference, same seed and config
    t_ref = time.monotonic() - t0

    # the run to kill: every rank pauses (up to 10 min) inside the save of step KILL_STEP
    job = Job(b, tmp_path / "b_killed.log", {"S3AC_TESTING_SAVE_PAUSE": f"600@{KILL_STEP}"})
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not all(m.exists() for m in markers):
            assert job.proc.poll() is None, "run ended before the paused save:\n" + job.output()[-3000:]
            assert time.monotonic() < deadline, "the save of step 3 never paused"
            job.track()
            time.sleep(0.05)
        # inside the window: the actor of step 3 is written, nothing of it is published yet
        assert (ck / "step_000002" / "COMPLETE").exists() and (ck / "step_000001" / "COMPLETE").exists()
        assert not (ck / f"step_{KILL_STEP:06d}").exists() and not (tmp_dir / "COMPLETE").exists()
        assert (tmp_dir / "actor").is_dir() and not (tmp_dir / "trainer_state.pt").exists()
        job.kill()
        assert len(job.groups) >= 3  # torchrun + the two ranks' own sessions
        assert job.proc.wait(timeout=60) == -signal.SIGKILL
        time.sleep(1.0)  # let the kernel finish tearing down the ranks
        survivors = job.survivors()
    finally:
        left = job.reap()
    assert not survivors and not left, f"orphans after SIGKILL of the group: {survivors or left}"

    # the killed save left only a .tmp: the latest checkpoint is the previous complete one
    assert latest_checkpoint(str(b)) == str(ck / "step_000002")
    assert tmp_dir.is_dir() and all(m.exists() for m in markers)
    killed_rows = [m["step"] for m in _metrics(b)]
    assert killed_rows == list(range(KILL_STEP))  # rows of steps 0..2 were logged before the kill

    t0 = time.monotonic()
    out = _run_to_end(b, tmp_path / "b_resumed.log")
    t_resume = time.monotonic() - t0
    assert f"resumed from {ck / 'step_000002'} at step 2" in out

    # the stale .tmp was removed by the next save (step 3, same name): nothing of it was published
    names = sorted(os.listdir(ck))
    assert names == ["step_000003", "step_000004"], names  # keep_last=2, no .tmp / trash left
    assert not any(f.startswith("PAUSED_rank") for f in os.listdir(ck / "step_000003"))
    assert (ck / "step_000003" / "COMPLETE").exists() and (ck / "step_000003" / "trainer_state.pt").exists()
    assert latest_checkpoint(str(b)) == str(ck / "step_000004")

    ma, mb = _metrics(a), _metrics(b)
    assert [m["step"] for m in mb] == [0, 1, 2, 3]
    assert [m for m in mb if m["step"] >= 2] == [m for m in ma if m["step"] >= 2]  # after the resume point
    assert ma == mb
    print(f"reference run {t_ref:.1f}s, resumed run {t_resume:.1f}s")


# ---- fast checks of the save's building blocks (no ranks) -------------------------------------------
def test_rotation_never_leaves_a_half_deleted_step_dir(tmp_path, monkeypatch):
    """A rotated / replaced checkpoint leaves the ``step_N`` namespace (rename) before it is deleted: a
    kill during the deletion (here: rmtree never runs) leaves a ``.tmp`` entry, never a ``step_N`` with
    ``COMPLETE`` but missing files; the next save deletes the leftover without renaming it again."""
    from megatron_s3ac.trainer.run import checkpoint as ck

    root = tmp_path / "checkpoints"
    old = root / "step_000001"
    (old / "actor").mkdir(parents=True)
    (old / "actor" / "__0_0.distcp").write_bytes(b"x")
    (old / "COMPLETE").touch()
    monkeypatch.setattr(ck.shutil, "rmtree", lambda *a, **k: None)  # "killed" before anything was removed
    ck._discard(str(old))
    left = os.listdir(root)
    assert len(left) == 1 and left[0].startswith("step_000001.trash-") and left[0].endswith(".tmp")
    assert ck.latest_checkpoint(str(tmp_path)) is None
    monkeypatch.undo()
    ck._discard(str(root / left[0]))  # what the next save does with stale .tmp entries
    assert os.listdir(root) == []
    (root / "BEST.tmp").write_text("step_000001\n")  # a stale file, not a dir
    ck._discard(str(root / "BEST.tmp"))
    assert os.listdir(root) == []


def test_fsync_ownership_of_checkpoint_files():
    """Every rank fsyncs the files it wrote; files of no rank (torch_dist metadata, trainer state) are
    rank 0's."""
    from megatron_s3ac.trainer.run.checkpoint import _OWNER_RE

    owner = lambda f: int(m[1]) if (m := _OWNER_RE.search(f)) else 0  # noqa: E731
    assert {f: owner(f) for f in ("rank1.pt", "rank12.pt", "rng_rank1.pt", "__1_0.distcp", "__0_3.distcp",
                                  "common.pt", "metadata.json", ".metadata", "trainer_state.pt", "COMPLETE")} == {
        "rank1.pt": 1, "rank12.pt": 12, "rng_rank1.pt": 1, "__1_0.distcp": 1, "__0_3.distcp": 0,
        "common.pt": 0, "metadata.json": 0, ".metadata": 0, "trainer_state.pt": 0, "COMPLETE": 0}
