"""A private SLURM cluster on this machine, for tests: ``munged``, ``slurmctld`` and one ``slurmd`` (one node, 2 CPUs)
from Debian's ``slurm-wlm`` and ``munge``, everything under one temporary directory — its own key, socket, ports,
state, spool and logs — so it never meets a system SLURM or another test session's cluster.

[Note: a test SLURM]
What each ``slurm.conf`` choice is for (tried in this project's container: gVisor, cgroup v1 hierarchies mounted):

* ``SlurmUser=root``, ``SlurmdUser=root``: one user owns the daemons, their state and the jobs (the test's), so
  nothing needs a ``slurm`` account or a ``chown``; ``slurmd`` must be root anyway to start tasks as the job's user.
* ``AuthType=auth/munge`` with ``AuthInfo=socket=<ours>``: a private ``munged`` with a key generated per cluster.
  ``cred_expire`` also sets how long a *requeued* job must wait before it may start again (SLURM's default: 120 s);
  :data:`REQUEUE_WAIT_S` keeps the requeue test short.
* ``ProctrackType=proctrack/linuxproc``: a step's processes are found through their parent ids in ``/proc``, no
  cgroup needed. ``proctrack/cgroup`` starts the daemons but fails every task launch here (srun: ``task 0 launch
  failed: Plugin initialization failed``; slurmstepd: ``cgroup namespace 'freezer' not mounted. aborting``).
  ``linuxproc`` loses a process that double-forks away from its task; nothing in a training job does, and the
  scancel test checks that no process is left.
* ``TaskPlugin=task/none``: no CPU binding. ``task/affinity`` works too (it pins task ``i`` to CPU ``i``), but on a
  machine shared with other test processes a pinned rank cannot move off a busy core; each task runs one thread
  (``OMP_NUM_THREADS=1``) on the CPU SLURM allocated it (``--cpus-per-task=1``).
* ``SelectType=select/cons_tres`` with ``CR_CPU``: CPUs are the consumable resource, as on a real cluster; a
  2-task job fills the node, so jobs run one after another.
* ``SchedulerParameters=sched_interval=1``: the main scheduling loop (default every 60 s) is what starts a requeued
  job once its wait is over.
* ``SlurmdParameters=config_overrides``: the node has the 2 CPUs the tests ask for whatever the machine's count.
* ``MpiDefault=none``: tasks find each other through Lightning's ``MASTER_ADDR``/``MASTER_PORT``, not PMI.
* ``KillWait`` is SLURM's default (30 s between SIGTERM and SIGKILL): the scancel test shows the tasks end on
  SIGTERM alone, well before it.

Every job of the cluster (its batch shell, srun, the tasks) and ``slurmd`` (whose ``slurmstepd`` processes run the
steps) carry :data:`MARKER` in their environment, the controller and ``munged`` (and their helpers, such as
``slurmctld``'s ``slurmscriptd``) :data:`DAEMON_MARKER`: :meth:`SlurmCluster.leftovers` finds what jobs left by
that (never by a process name), and :meth:`SlurmCluster.stop` ends whatever carries either.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.distributed.launcher import _free_port

BINARIES = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "scontrol", "sinfo", "squeue")
MARKER = "LIGHTNING_PIPE_TEST_SLURM"
DAEMON_MARKER = "LIGHTNING_PIPE_TEST_SLURM_DAEMON"
CPUS = 2
START_TIMEOUT_S = 60.0
REQUEUE_WAIT_S = 5
"""``cred_expire``: seconds a requeued job waits before it may start again (slurmctld refuses less than 5 and
falls back to 120)."""


def unavailable() -> str | None:
    """Why a private SLURM cannot run here (a skip reason), or None."""
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        return (f"needs Debian's slurm-wlm and munge (apt-get install slurm-wlm munge; .ci/run installs them): "
                f"{', '.join(missing)} not found")
    if os.geteuid() != 0:
        return "needs root: slurmd starts the jobs' tasks (SlurmdUser=root) and munged serves the cluster's key"
    return None


def slurm_conf(root: Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    """The cluster's slurm.conf ([Note: a test SLURM])."""
    return "\n".join([
        "ClusterName=lptest",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge-socket' / 'socket'},cred_expire={REQUEUE_WAIT_S}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=verbose",  # slurmstepd logs how each task ended
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=1",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "JobRequeue=1",
        "ReturnToService=2",
        "MailProg=/bin/true",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN",
        f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


class SlurmCluster:
    """One started cluster: run its client commands with :attr:`env` (``SLURM_CONF`` names its config)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname()
        self.conf = root / "etc" / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}  # client commands (jobs get MARKER too)
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}

    # ------------------------------------------------------------------ clients
    def command(self, *args: str, timeout: float = 30) -> str:
        """A client command (``sinfo``, ``scontrol`` ...) against this cluster; its stdout."""
        proc = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, script: Path, *args: str, options: tuple[str, ...] = (), env: dict[str, str]) -> int:
        """``sbatch [options] script [args]`` with ``env`` (plus this cluster's variables); the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], env={**env, **self._own_env()},
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed ({proc.returncode}): {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        fields: dict[str, str] = {}
        for item in self.command("scontrol", "show", "job", "--oneliner", str(job_id)).split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: int, states: set[str], timeout: float, poll: float = 0.2) -> dict[str, str]:
        """Wait until the job's state is one of ``states``; its fields then. Fails with the job's fields on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not in {sorted(states)} after {timeout:.0f} s: {fields}")
            time.sleep(poll)

    def task_ends(self, step: str) -> dict[int, str]:
        """How each task of ``step`` ("<job>.<step>") ended, from slurmstepd's log: {task: "exit code N" or
        "Killed by signal N"}."""
        text = (self.root / "log" / "slurmd.log").read_text(errors="replace")
        pattern = rf"\[{re.escape(step)}\] task (\d+) \(\d+\) exited(?: with|\.) (exit code \d+|Killed by signal \d+)"
        return {int(task): how for task, how in re.findall(pattern, text)}

    def leftovers(self, marker: str = MARKER) -> dict[int, str]:
        """Processes (pid: command line) whose environment carries this cluster's ``marker``: by default what its
        jobs started (``slurmd`` itself excluded)."""
        needle = f"{marker}={self.root}".encode()
        daemons = {p.pid for p in self.daemons.values()} | {os.getpid()}
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in daemons:
                continue
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:  # ended meanwhile, or a kernel thread
                continue
        return {pid: cmd for pid, cmd in found.items() if cmd}

    def _own_env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf), MARKER: str(self.root)}

    # ------------------------------------------------------------------ daemons
    def start(self) -> None:
        try:  # the node's name is the address Lightning gives the tasks (MASTER_ADDR, from SLURM_NODELIST)
            socket.gethostbyname(self.node)
        except OSError as err:
            raise RuntimeError(f"private SLURM: this machine's host name {self.node!r} does not resolve ({err}); "
                               "Lightning's SLURMEnvironment uses it as the rendezvous address") from err
        for sub in ("etc", "munge", "munge-socket", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)  # munged refuses a key directory others can read
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(slurm_conf(self.root, self.node, _free_port(), _free_port()))
        socket_path = self.root / "munge-socket" / "socket"
        self._daemon("munged", DAEMON_MARKER, ["munged", "--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
                                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                                f"--log-file={self.root / 'log' / 'munged.log'}"])
        self._until(lambda: subprocess.run(["munge", "--no-input", f"--socket={socket_path}"],
                                           capture_output=True).returncode == 0, "munged answers")
        self._daemon("slurmctld", DAEMON_MARKER, ["slurmctld", "-D", "-f", str(self.conf)])
        self._until(lambda: self._quiet("scontrol", "ping").endswith("is UP"), "slurmctld answers")
        self._daemon("slurmd", MARKER, ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._until(lambda: self._quiet("sinfo", "--noheader", "--nodes", self.node, "--format=%T") == "idle",
                    f"sinfo shows node {self.node} idle")

    def _daemon(self, name: str, marker: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        env = {**os.environ, "SLURM_CONF": str(self.conf), marker: str(self.root)}
        self.daemons[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _quiet(self, *args: str) -> str:
        proc = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=30)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    def _until(self, ready: object, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():  # type: ignore[operator]
            dead = {n: p.returncode for n, p in self.daemons.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                reason = f"exited {dead}" if dead else f"not after {START_TIMEOUT_S:.0f} s"
                raise RuntimeError(f"private SLURM: waiting until {what}: {reason}\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, lines: int = 15) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()
            parts.append(f"--- {path.name} ---\n" + "\n".join(text[-lines:]))
        return "\n".join(parts)

    def cancel_all(self, timeout: float = 40) -> None:
        """Cancel every job (the batch shell too) and wait until none is left in the queue."""
        if "slurmctld" not in self.daemons or self.daemons["slurmctld"].poll() is not None:
            return
        jobs = self._quiet("squeue", "--noheader", "--format=%i").split()
        if jobs:
            subprocess.run(["scancel", "--full", *jobs], env=self.env, capture_output=True, timeout=30)
            deadline = time.monotonic() + timeout
            while self._quiet("squeue", "--noheader", "--format=%i") and time.monotonic() < deadline:
                time.sleep(0.5)

    def stop(self) -> None:
        """Cancel every job, end the daemons and whatever their jobs left, remove the state."""
        self.cancel_all()
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for pid in {**self.leftovers(), **self.leftovers(DAEMON_MARKER)}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """A started cluster under ``root``; stopped and removed on exit, also when the block fails."""
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
