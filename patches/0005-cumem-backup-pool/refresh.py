#!/usr/bin/env python3
"""Write the new module of patch 0005 into the patch from its source beside this file.

    python3 patches/0005-cumem-backup-pool/refresh.py [--check]

The module (vllm/device_allocator/cumem_backup_pool.py under this folder) is kept as a
real file so that it can be read, linted and tested; the patch carries it as a new
file. This rewrites that one section of patches/0005-cumem-backup-pool.patch and
leaves the rest (the hunks into cumem.py and envs.py) as it is. --check only says
whether the patch is in step (exit 1 when not); tests/test_backup_pool.py checks it.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULE = "vllm/device_allocator/cumem_backup_pool.py"
PATCH = HERE.parent / "0005-cumem-backup-pool.patch"


def section(text: str) -> str:
    lines = text.splitlines()
    blob = hashlib.sha1(b"blob %d\0" % len(text.encode()) + text.encode()).hexdigest()[:7]
    head = [f"diff --git a/{MODULE} b/{MODULE}", "new file mode 100644", f"index 0000000..{blob}",
            "--- /dev/null", f"+++ b/{MODULE}", f"@@ -0,0 +1,{len(lines)} @@"]
    return "\n".join(head + ["+" + line for line in lines]) + "\n"


def refreshed(patch: str, text: str) -> str:
    start = patch.index(f"diff --git a/{MODULE} ")
    end = patch.find("\ndiff --git ", start + 1)
    rest = "" if end < 0 else patch[end + 1:]
    return patch[:start] + section(text) + rest


def main(argv: list[str]) -> int:
    patch = PATCH.read_text()
    new = refreshed(patch, (HERE / MODULE).read_text())
    if "--check" in argv:
        if new != patch:
            print(f"{PATCH.name} does not carry {MODULE} as it is beside {Path(__file__).name}: run it without --check")
            return 1
        return 0
    PATCH.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
