#!/bin/sh
# Usage: cli_refuses.sh EXPECTED COMMAND [ARG...]
# Passes when COMMAND exits with a non-zero status and its output (stdout and stderr together)
# matches the extended regular expression EXPECTED: input the CLI refuses, naming what was wrong.
expected=$1
shift
if output=$("$@" 2>&1); then
  printf 'exited 0; expected a refusal matching /%s/:\n%s\n' "$expected" "$output"
  exit 1
fi
if ! printf '%s\n' "$output" | grep -Eq -- "$expected"; then
  printf 'expected /%s/ in:\n%s\n' "$expected" "$output"
  exit 1
fi
