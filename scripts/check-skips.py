#!/usr/bin/python3
"""Fails a test run that skipped a test for a reason the allowlist does not name.

Usage: scripts/check-skips.py --allow tests/allowed-skips.txt JUNIT_FILE...

Reads the JUnit XML files of one run of scripts/run-tests.sh (ctest --output-junit and pytest
--junitxml), finds every skipped test and its reason, and matches each against the allowlist
(format: tests/allowed-skips.txt). Prints one line counting the skips by allowlist label; exits 1
listing each skip no entry allows, and on anything that keeps it from telling (a JUnit file
missing, unreadable or without tests, an allowlist entry without a comment). Standard library
only: it runs under /usr/bin/python3 before anything else is installed.

What counts as a skip:
- ctest: GoogleTest's "[  SKIPPED ]" in a test's output, whatever ctest made of the test. A test
  registered by gtest_discover_tests runs one GoogleTest case and ctest reports it skipped
  (SKIP_REGULAR_EXPRESSION, tests/CMakeLists.txt); an add_test() entry that runs several cases
  passes with some of them skipped, and each of those counts. The reason is what GTEST_SKIP()
  printed: the lines between "<file>:<line>: Skipped" and "[  SKIPPED ] <name>". A ctest
  test skipped or disabled for any other reason counts with ctest's own message. A case that
  GoogleTest's summary lists as skipped but whose block is not in the output (truncated) counts
  with a reason no entry allows.
- pytest: a <skipped> element (pytest.skip, skipif, importorskip; an xfail is never allowed).

SKIP_REGULAR_EXPRESSION makes ctest report a skip whatever the exit status was, so a skipped
ctest test whose output also shows a GoogleTest failure or a sanitizer's report is an error here.
"""

import argparse
import collections
import os
import re
import sys
import xml.etree.ElementTree as ET

RUN = re.compile(r"^\[ RUN      \] (\S+)\s*$")
SKIP_MARK = re.compile(r"^\S.*:\d+: Skipped\s*$")
SKIPPED = re.compile(r"^\[  SKIPPED \] (\S+) \(\d+ ms\)\s*$")
SUMMARY = re.compile(r"^\[  SKIPPED \] \d+ tests?, listed below:\s*$")
SUMMARY_NAME = re.compile(r"^\[  SKIPPED \] (\S+)\s*$")
# What a skip must not hide (the exit status is lost once ctest calls the test skipped).
HIDDEN_FAILURE = re.compile(
    r"^\[  FAILED  \] |^SUMMARY: (Address|Leak|Thread|UndefinedBehavior|Memory)Sanitizer|"
    r"^WARNING: ThreadSanitizer:|^==\d+==ERROR: |: runtime error: ",
    re.M,
)
NO_REASON = "(no reason printed)"


class Entry:
    def __init__(self, label, reason, test, comment, where):
        self.label, self.comment, self.where = label, comment, where
        self.reason = re.compile(reason)
        self.test = re.compile(test) if test else None
        self.used = 0

    def allows(self, test, reason):
        if self.test is not None and not self.test.search(test):
            return False
        return self.reason.match(reason) is not None


def read_allowlist(path):
    """Entries: blocks separated by blank lines; '#' lines are the comment (required), then
    'label: ...', 'reason: <regex>' (matched at the start of the reason) and optionally
    'test: <regex>' (searched in the test's name)."""
    entries, errors = [], []
    with open(path, encoding="utf-8") as file:
        lines = file.read().split("\n")
    block, start = [], 1
    for number, line in enumerate(lines + [""], 1):
        if line.strip():
            if not block:
                start = number
            block.append(line)
            continue
        if not block:
            continue
        comment = [l for l in block if l.lstrip().startswith("#")]
        fields = {}
        for l in block:
            if l.lstrip().startswith("#"):
                continue
            key, sep, value = l.partition(":")
            key = key.strip()
            if not sep or key not in ("label", "reason", "test") or key in fields:
                errors.append(f"{path}:{start}: bad line {l!r}")
                continue
            fields[key] = value.strip()
        block = []
        if not fields:  # a comment block of its own (the file's header)
            continue
        where = f"{path}:{start}"
        if not comment:
            errors.append(f"{where}: entry without a comment saying why it is allowed")
        if "label" not in fields or "reason" not in fields:
            errors.append(f"{where}: entry needs 'label:' and 'reason:'")
            continue
        try:
            entries.append(Entry(fields["label"], fields["reason"], fields.get("test"),
                                 comment, where))
        except re.error as error:
            errors.append(f"{where}: bad regular expression: {error}")
    return entries, errors


def gtest_skips(output):
    """[(case name, reason)] of the GoogleTest cases the output shows skipped."""
    skips, summary = [], []
    current, reason, in_summary = None, None, False
    for line in output.split("\n"):
        if SUMMARY.match(line):
            in_summary = True
            continue
        if in_summary:
            named = SUMMARY_NAME.match(line)
            if named:
                summary.append(named.group(1))
                continue
            in_summary = False
        run = RUN.match(line)
        if run:
            current, reason = run.group(1), None
            continue
        if SKIP_MARK.match(line):
            reason = []
            continue
        skipped = SKIPPED.match(line)
        if skipped:
            text = "\n".join(reason).strip() if reason is not None else ""
            skips.append((skipped.group(1), text or NO_REASON))
            current, reason = None, None
            continue
        if reason is not None and current is not None:
            reason.append(line)
    seen = {name for name, _ in skips}
    for name in summary:
        if name not in seen:
            skips.append((name, "(listed as skipped, but its output is missing: truncated?)"))
    return skips


def skips_of(path):
    """[(test, reason, where)] skipped in one JUnit file, and errors."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as error:
        return [], [f"{path}: cannot read it: {error}"]
    cases = list(root.iter("testcase"))
    if not cases:
        return [], [f"{path}: no test cases"]
    skips, errors = [], []
    base = os.path.basename(path)
    for case in cases:
        name = case.get("name", "?")
        output = case.findtext("system-out") or ""
        skipped = case.find("skipped")
        if case.get("status") is not None:  # ctest
            status = case.get("status")
            found = gtest_skips(output)
            for test, reason in found:
                # Discovered tests are named after their case (plus "  # GetParam() = ...").
                where = base if name.split()[0] == test else f"{base}, ctest {name}"
                skips.append((test, reason, where))
            if status in ("notrun", "disabled"):
                if not found:
                    message = skipped.get("message", "") if skipped is not None else ""
                    skips.append((name, f"ctest: {status} ({message or 'no message'})", base))
                hidden = HIDDEN_FAILURE.search(output)
                if hidden:
                    errors.append(f"{base}: ctest {name} counts as skipped but its output shows "
                                  f"a failure: {hidden.group(0).strip()!r}")
        elif skipped is not None:  # pytest
            test = f"{case.get('classname', '')}::{name}".lstrip(":")
            kind = skipped.get("type", "")
            reason = skipped.get("message") or (skipped.text or "").strip() or NO_REASON
            if kind == "pytest.xfail":
                reason = f"xfail: {reason}"
            skips.append((test, reason, base))
    return skips, errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allow", required=True, help="the allowlist (tests/allowed-skips.txt)")
    parser.add_argument("junit", nargs="+", help="JUnit XML files of the run")
    args = parser.parse_args()

    entries, errors = read_allowlist(args.allow)
    by_label = collections.Counter()
    refused = []
    total = 0
    for path in dict.fromkeys(args.junit):  # a file named twice is read once
        if not os.path.isfile(path):
            errors.append(f"{path}: missing (its tests ran, so its JUnit file must exist)")
            continue
        skips, file_errors = skips_of(path)
        errors += file_errors
        for test, reason, where in skips:
            total += 1
            entry = next((e for e in entries if e.allows(test, reason)), None)
            if entry is None:
                refused.append((test, reason, where))
                by_label["NOT ALLOWED"] += 1
            else:
                entry.used += 1
                by_label[entry.label] += 1

    counts = ", ".join(f"{label}: {n}" for label, n in sorted(by_label.items()))
    print(f"=== skips: {total} in {len(args.junit)} JUnit file(s)" + (f" ({counts})" if counts
                                                                       else ""))
    if refused:
        print(f"=== {len(refused)} skip(s) for a reason {args.allow} does not allow "
              "(only environment reasons such as no GPU may skip in CI):")
        for test, reason, where in refused:
            lines = reason.split("\n")
            more = f" (+{len(lines) - 1} lines)" if len(lines) > 1 else ""
            print(f"  {test} [{where}]: {lines[0]}{more}")
    for error in errors:
        print(f"=== error: {error}")
    return 1 if refused or errors else 0


if __name__ == "__main__":
    sys.exit(main())
