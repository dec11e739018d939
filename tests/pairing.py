"""The one-process tests, two files at a time: the suite's tests marked `one_process` (no world,
no command: the pytest process alone, mostly on one core; a whole file's or a single test's
mark) run in two pytest processes at once, before anything else, so the machine's second
core does not sit idle through them.

Measured on the 2-core machine (`make test`, 2026-12-02): the tests left the machine idle a
third of the time (226 of 682 core-seconds), and the one-process files (the planner's, the
rules', the fuzzer's, the compiled MoE block's...) were about 65 s of wall time at half its
cores. Worlds are not paired: two worlds' ranks on the same two cores wait for each other's
turns at every collective (docs/design.md, "The suite runs in one pytest process").

How: this session moves the marked tests first and starts a second pytest on their files, in
reverse order, with the same `-m` and `-k` (and the mark: a world file's marked tests alone).
Each process claims a file as it reaches it (`os.mkdir` of the file's name in a shared folder:
exactly one succeeds) and passes over the files the other claimed, so the two meet where the
work halves, whatever each file costs.
The second process writes its tests' reports; this one waits for it before the first
unmarked test and replays them (`pytest_report_from_serializable`, as pytest-xdist does), so
counts, failures and durations read as one run. A file the second process claimed but did
not report (it crashed, or was stopped) fails here, naming why.

Each of the two runs torch's operators on half the cores' threads while both run (the main
process takes its own back for the worlds), as plait gives each rank its share: with every
core's thread in each, the two processes' OpenMP threads outnumber the cores, and a parallel
region waits at its barrier for a thread the scheduler has parked. Two processes each
stepping plait's tiny GPT at once took 12-184 ms a step with 2 threads each, 5-8 ms with one
(this 2-core host, idle otherwise). The paired files do little such work: their two halves,
run side by side, took the same with either (108.7 and 89.7 s, 110.8 and 92.8 s) on the idle
host; on the host busy with other jobs, 400 and 308 s with 2 threads, 356 and 232 s with one.

Engaged only for a run of the suite or a folder of it (as the worlds' pool starts);
PLAIT_TEST_PAIR=0 turns it off. A test of a marked file that starts a world or a command
fails (tests/worldlib.py asks `starting_processes`): the mark would then be a lie.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

MARK = "one_process"
CHILD = "PLAIT_TEST_PAIR_CHILD"  # in the second process: the shared folder
WAIT_S = 1800  # the second process ends well before this, or is stopped and its files fail here
_running_marked: list[str] = []  # the marked test running in this process, if any
_SECOND: list["Pairing"] = []  # in the second process: its side, which writes the reports


def starting_processes(what: str) -> None:
    """Called by tests/worldlib.py before it starts a world or a command: refused inside a
    test of a `one_process` file, which may be running beside another such file."""
    if _running_marked:
        raise AssertionError(f"{_running_marked[0]} is marked {MARK} (tests/pairing.py) but starts {what}: "
                             f"unmark its file, or move the test")


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _marked(item: pytest.Item) -> bool:
    return item.get_closest_marker(MARK) is not None


class Pairing:
    """One process's side: the claims, and in the main process the second one and its reports."""

    def __init__(self, config: pytest.Config, folder: Path, main: bool) -> None:
        self.config, self.folder, self.main = config, folder, main
        self.claimed: dict[str, bool] = {}  # file -> claimed by this process
        self.deferred: list[pytest.Item] = []  # main: the other's tests, replayed once it ends
        self.child: subprocess.Popen | None = None
        self.replayed = False
        self.ran = False  # the test loop began: an interrupted or failed collection replays nothing
        self.threads: int | None = None  # main: torch's threads before the pair shared the cores

    def claim(self, path: str) -> bool:
        if path not in self.claimed:
            try:
                os.mkdir(self.folder / path.replace("/", "__"))
                self.claimed[path] = True
            except FileExistsError:
                self.claimed[path] = False
        return self.claimed[path]

    def start_child(self, files: list[str]) -> None:
        env = {**os.environ, CHILD: str(self.folder)}
        option = self.config.option
        marks = f"({option.markexpr}) and {MARK}" if option.markexpr else MARK  # a world file's marked tests alone
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks,
                   *(["-k", option.keyword] if option.keyword else []), *reversed(files)]
        with open(self.folder / "child.log", "w") as log:
            try:
                self.child = subprocess.Popen(command, cwd=self.config.rootpath, env=env, stdout=log,
                                              stderr=subprocess.STDOUT)
            except OSError:  # no second process: this one claims every file as it reaches it
                self.child = None
        if self.child is not None:
            self.threads = _share_the_cores()

    def replay(self) -> None:
        """Wait for the second process, then report its tests here, in their order."""
        if self.replayed or self.child is None:
            return
        self.replayed = True
        try:
            code = self.child.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.child.kill()
            code = self.child.wait()
        _set_threads(self.threads)  # the cores are this process's again
        reports: dict[str, list] = {}
        path = self.folder / "reports.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            report = self.config.hook.pytest_report_from_serializable(config=self.config, data=json.loads(line))
            reports.setdefault(report.nodeid, []).append(report)
        hook = self.config.hook
        for item in self.deferred:
            hook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
            for report in reports.get(item.nodeid) or [self._missing(item, code)]:
                hook.pytest_runtest_logreport(report=report)
            hook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)

    def _missing(self, item: pytest.Item, code: int) -> pytest.TestReport:
        log = (self.folder / "child.log").read_text(errors="replace")[-3000:]
        why = f"the paired pytest (tests/pairing.py) claimed {_file(item)} but did not report this test " \
              f"(it exited with code {code}); its output's end:\n{log}"
        return pytest.TestReport(item.nodeid, item.location, {}, "failed", why, "call")

    def stop(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _share_the_cores() -> int:
    """Run torch's operators on half this process's threads (one of two processes on the
    cores); returns how many it had."""
    import torch

    threads = torch.get_num_threads()
    _set_threads(max(1, threads // 2))
    return threads


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _engaged(config: pytest.Config) -> bool:
    args = config.args
    return os.environ.get("PLAIT_TEST_PAIR", "1") != "0" and bool(args) and all(os.path.isdir(arg) for arg in args)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}: runs in the pytest process alone (no world, no command), so it "
                                       "may run beside another such file (tests/pairing.py)")
    if os.environ.get(CHILD):
        config.stash[_KEY] = Pairing(config, Path(os.environ[CHILD]), main=False)
        _SECOND[:] = [config.stash[_KEY]]
        _share_the_cores()  # for its whole life: it runs only while the main process runs marked files


_KEY = pytest.StashKey[Pairing]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a run of the suite: the marked files' tests first, and the second process started on them."""
    if _KEY in config.stash or not _engaged(config):
        return
    marked = [item for item in items if _marked(item)]
    files = list(dict.fromkeys(_file(item) for item in marked))
    if len(files) < 2:
        return
    items[:] = marked + [item for item in items if not _marked(item)]
    pairing = Pairing(config, Path(tempfile.mkdtemp(prefix="plait-pair-")), main=True)
    config.stash[_KEY] = pairing
    pairing.start_child(files)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """A marked test runs here if this process claimed its file (and, paired or not, may not
    start processes); the main process replays the other's reports before its first unmarked test."""
    pairing = item.config.stash.get(_KEY, None)
    if pairing is not None:
        pairing.ran = True
    if not _marked(item):
        if pairing is not None and pairing.main:
            pairing.replay()
        return None
    if pairing is None or pairing.claim(_file(item)):
        _running_marked[:] = [item.nodeid]
        return None
    if pairing.main:
        pairing.deferred.append(item)
    return True  # the other process runs it


def pytest_runtest_logfinish(nodeid: str) -> None:
    _running_marked.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In the second process: each report of a test it ran, for the main one to replay."""
    if not _SECOND:
        return
    config = _SECOND[0].config
    data = config.hook.pytest_report_to_serializable(config=config, report=report)
    with open(_SECOND[0].folder / "reports.jsonl", "a") as out:
        out.write(json.dumps(data) + "\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    pairing = session.config.stash.get(_KEY, None)
    if pairing is None or not pairing.main:
        return
    if pairing.ran and session.exitstatus != pytest.ExitCode.INTERRUPTED:
        pairing.replay()  # every test was marked: nothing came after them
    pairing.stop()
    if session.testsfailed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
