"""docs/migration.md's code blocks run, in order, in one namespace (each block's asserts check entoscope
against TransformerLens and nnsight written by hand)."""

import linecache
import re
from pathlib import Path


from extras import require

require("nnsight")

PAGE = Path(__file__).resolve().parent.parent / "docs" / "migration.md"


def test_the_migration_pages_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for i, block in enumerate(blocks):
        name = f"<{PAGE.name} block {i + 1}>"
        linecache.cache[name] = (len(block), None, block.splitlines(True), name)  # nnsight reads a trace's source
        exec(compile(block, name, "exec"), namespace)
    assert len(namespace["by_hand"]) == len(namespace["with_nnsight"]) == 4
