"""The shipped storage suite fails every broken backend of ``broken_storage``, every time, with
a message that names the problem; the correct one beside them passes the same tests.

One pytest run in a child process (as a plugin author runs the suite) holds a subclass of
``k3.testing.StorageConformance`` per variant, each selecting the part of the suite that
concerns its break, and one for the unbroken base selecting all of those parts. The
shared-position variant (a seek then a read on one descriptor) runs five times over: the
concurrency test must catch it every time. Each test below reads that run's report.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3core.testing.storage_conformance import SIZE

HERE = Path(__file__).resolve().parent
RACY_RUNS = 5

#: variant -> (its class, the suite's tests that concern it (-k), what the failure must say)
CASES: dict[str, tuple[str, str, str]] = {
    "short-at-eof": (
        "ShortAtEof", "out_of_range or truncated",
        rf"read_into\(offset={SIZE - 5}, 10 bytes\) of data\.bin \({SIZE} bytes\) returned "
        r"instead of raising StorageError \(a range outside the file is refused"),
    "drop-low-bits": (
        "DropLowBits", "big_reads and 1MiB",
        r"read_into\(offset=4095, 1048577 bytes\) of big\.bin into numpy-\w+: \d+ of 1048577 "
        r"bytes differ; first at \+0 \(file offset 4095\): got 0x[0-9a-f]{2}, want "
        r"0x[0-9a-f]{2} \(the bytes from \+0 on are the file's bytes at offset 0, -4095 from "
        r"where they belong: read at the wrong position\)"),
    "stale-cache": (
        "StaleCache", "replaced_file",
        r"after the file was replaced by a rename: read_into\(offset=0, 196731 bytes\) of "
        r"replaced\.bin: \d+ of 196731 bytes differ; first at \+\d+ .*\(these are the bytes "
        r"of the file that was at this path before: stale\)"),
    "leaky": (
        "Leaky", "handles_released",
        r"64 x \(open, read_into, close\) left 64 more descriptors open in this process "
        r"\(\d+ -> \d+\): close\(\) or a failed open\(\) does not release what open\(\) took"),
    "plain-exception": (
        "PlainException", "missing_file",
        r"open\(\S+no-such-file\.bin\) raised Exception: \S+no-such-file\.bin: No such file "
        r"or directory instead of StorageError"),
    "keeps-resident": (
        "KeepsResident", "resident",
        r"reading 50\.\d MB of big\.bin through one open file in 1052675-byte reads grew this "
        r"process's resident memory by \d+\.\d MB \(resident set [-+]\d+\.\d MB, Python "
        r"objects \+\d+\.\d MB; allowed 8\.4 MB\): the backend keeps what it read resident"),
    "uncounted": (
        "Uncounted", "stats",
        r"after 5 reads of 58527 bytes \(one of 0 bytes\) and one refused, stats count 0 bytes "
        r"in 0 calls"),
    "thread-crash": (
        "ThreadCrash", "range_matches_python and whole-file and numpy-aligned",
        r"ThreadFailure: the test: 1 exception\(s\) escaped a thread \(raised where nothing "
        r"caught them\); first, in thread 'read-ahead': TypeError"),
}
SHARED = ("concurrent_reads",
          r"16 threads reading one open file at once \(a backend whose reads share a file "
          r"position, a seek then a read without a lock, fails so\): \d+ of \d+ "
          r"(reads returned wrong bytes; first: read_into\(offset=\d+, \d+ bytes\) of data\.bin"
          r".*first at \+\d+ \(file offset \d+\)|threads raised)")

CLASS = '''
class Test{cls}(StorageConformance):
    @pytest.fixture
    def storage_backend(self):
        return broken_storage.VARIANTS[{variant!r}]()
'''


def _suite_file() -> tuple[str, str]:
    """The generated test module and its -k expression."""
    text = "import pytest\nimport broken_storage\nfrom k3.testing import StorageConformance\n"
    select = []
    for variant, (cls, k, _) in CASES.items():
        text += CLASS.format(cls=cls, variant=variant)
        select.append(f"(Test{cls} and ({k}))")
    for i in range(RACY_RUNS):
        text += CLASS.format(cls=f"SharedPosition{i}", variant="shared-position")
        select.append(f"(TestSharedPosition{i} and {SHARED[0]})")
    text += CLASS.format(cls="Good", variant="good")
    every = " or ".join([f"({k})" for _, k, _ in CASES.values()] + [SHARED[0]])
    select.append(f"(TestGood and ({every}))")
    return text, " or ".join(select)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The run's failure sections by class name, plus ``"summary"``: the whole report."""
    work = tmp_path_factory.mktemp("suite-catches")
    text, select = _suite_file()
    (work / "test_variants.py").write_text(text)
    disk = work / "data-disk"  # the run must write there, and say so
    env = {**os.environ, "K3_TEST_DISK_DIR": str(disk),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--tb=short", "-k", select, "test_variants.py"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    sections: dict[str, str] = {"summary": out, "disk": str(disk)}
    head = re.compile(r"^_+ (?:ERROR at \w+ of )?Test(\w+)\.\S+ _+$", re.M)
    marks = list(head.finditer(out))
    for m, nxt in zip(marks, marks[1:] + [None], strict=True):
        body = out[m.end() : nxt.start() if nxt else len(out)]
        sections[m.group(1)] = sections.get(m.group(1), "") + body
    return sections


@pytest.mark.parametrize("variant", list(CASES))
def test_the_suite_fails_the_broken_backend(report: dict[str, str], variant: str) -> None:
    cls, _, message = CASES[variant]
    text = report.get(cls)
    assert text, f"Test{cls} ({variant}) failed nothing:\n{report['summary'][-3000:]}"
    assert re.search(message, text), f"no failure of {variant} says /{message}/:\n{text[-4000:]}"
    assert not re.search(r"^E\s+AssertionError\s*$", text, re.M), f"a bare AssertionError:\n{text}"


def test_the_shared_position_is_caught_every_time(report: dict[str, str]) -> None:
    for i in range(RACY_RUNS):
        text = report.get(f"SharedPosition{i}")
        assert text, f"run {i} of the shared-position backend passed:\n{report['summary'][-3000:]}"
        assert re.search(SHARED[1], text), f"run {i} does not say /{SHARED[1]}/:\n{text[-4000:]}"


def test_the_run_says_where_it_wrote(report: dict[str, str]) -> None:
    lines = [line for line in report["summary"].splitlines() if "k3 storage suite:" in line]
    assert len(lines) == 1, report["summary"][-2000:]  # once for the whole run
    assert re.fullmatch(rf"k3 storage suite: test data under {re.escape(report['disk'])}"
                        r"( \(\w+\))?: from \$K3_TEST_DISK_DIR", lines[0]), lines[0]


def test_the_correct_backend_passes_the_same_tests(report: dict[str, str]) -> None:
    """The variants' common base, unbroken, passes every test the cases select."""
    assert "Good" not in report, f"the correct backend failed:\n{report['Good'][-4000:]}"
    summary = report["summary"]
    failed = re.search(r"(\d+) failed", summary)
    expected = len(CASES) + RACY_RUNS
    assert re.search(r"\d+ passed", summary), summary[-3000:]
    assert failed and int(failed.group(1)) >= expected - 1, summary[-3000:]  # thread-crash errors
