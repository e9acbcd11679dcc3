"""The README's "Use" example runs as written (here on CPU devices: the XLA transport)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_use_example_runs():
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert blocks, "the README has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme"})
