"""Prints `NAME PATH` for every test executable in cargo's `--message-format=json` stream on
stdin: the library's unit tests are named after the crate, integration tests after their file.
Used by `cuda_suite.sh` and `make_carry.sh` to copy release test binaries for the GPU machine.
"""

import json
import sys

for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    artifact = m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test")
    if artifact and m.get("executable"):
        print(m["target"]["name"], m["executable"])
