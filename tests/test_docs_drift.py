"""Docs that cannot drift from the code: every repository path they name exists, and every public
function, parameter and option is in docs/api.md with the signature ``inspect.signature`` gives.

What counts as a repository path (``path_tokens``): a token, backticked or bare, that
- contains a ``/`` and ends in a known file extension or a ``/`` (a folder), or starts with one
  of the repository's top-level folders (``docs/``, ``ffi/``, ...); or
- has no ``/`` but ends in a source or document extension (``BARE_EXTENSIONS``): it must be the
  name of a file of the repository somewhere, so that a document of the machinery outside the
  repository, cited by its bare name, is drift.
It resolves against the repository's root or the citing file's folder. Paths that leave the
repository (up past its root) are drift: nothing in the repository may cite files outside it.
Not paths: absolute paths (``/usr/local/cuda``), URLs, globs and templates (``*``, ``{tag}``;
braces with commas are expanded), and the other projects' files in ``EXTERNAL``.

Where: ``docs/*.md`` and every README.md (``DOCUMENTS``); comments and docstrings of the Python,
shell and C++/CUDA files under ``SOURCE_DIRS``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import os
import re
import subprocess
import textwrap
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("jax_cpgrad", "benchmarks", "experiments", "tests", "scripts", "ffi")
TOP_LEVEL = (
    "docs",
    "jax_cpgrad",
    "benchmarks",
    "experiments",
    "tests",
    "scripts",
    "ffi",
    "examples",
    "cmake",
)
EXTENSIONS = (
    ".py", ".pyi", ".md", ".sh", ".h", ".cc", ".cu", ".cuh", ".json", ".toml", ".txt", ".log", ".png",
    ".csv", ".cmake",
)  # fmt: skip
# Other projects' files that the repository's comments cite as models (the style guide's
# anchors), and placeholders (a user's ``script.py``).
EXTERNAL = re.compile(
    r"^(jax|jaxlib|xla|tokamax|jax-ml|pallas|torch|c10|transformer_engine)/"
    r"|^(cuda_examples\.cu|gpu_examples\.cc|rms_norm\.cc|gpu_kernel_helpers\.h|prng_kernels[\w.]*"
    r"|CUDASymmetricMemory-inl\.cuh|collective_signal\.cu\.h|multi_gpu_barrier_kernel\.h"
    r"|all_reduce_kernel_lib\.cu\.h|lowering\.py|ep\.cpp|nn_test\.py|functions\.py|nvcc\.profile|script\.py)$"
)
# A name without a folder that ends so is a file of the repository somewhere (``api.md``,
# ``fused_kernels.h``); other extensions are too often outputs or other projects' files.
BARE_EXTENSIONS = (".py", ".pyi", ".md", ".sh", ".h", ".cc", ".cu", ".cuh")
_TOKEN = re.compile(r"[\w.\-/{},*<>$~%]+")


# -- which files, and their prose --------------------------------------------------------------


def repository_files(root: Path = ROOT) -> list[str]:
    """The repository's files (tracked, and untracked ones git does not ignore), relative."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return sorted(p for p in out.splitlines() if (root / p).exists())
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "venv", "build", "__pycache__", ".whl", ".pytest_cache"}
        found = []
        for base, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
            found += [os.path.relpath(os.path.join(base, f), root) for f in files]
        return sorted(found)


def documents(files: list[str]) -> list[str]:
    return [f for f in files if (f.startswith("docs/") and f.endswith(".md")) or Path(f).name == "README.md"]


def sources(files: list[str]) -> list[str]:
    kinds = (".py", ".sh", ".h", ".cc", ".cu", ".cuh")
    return [f for f in files if f.split("/")[0] in SOURCE_DIRS and f.endswith(kinds)]


def python_prose(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    out += [(first.lineno + i, s) for i, s in enumerate(first.value.value.splitlines())]
    return out


def shell_prose(text: str) -> list[tuple[int, str]]:
    """(line, comment) of a shell script: from a ``#`` outside quotes to the end of the line."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        quote = None
        for i, ch in enumerate(line):
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1].isspace()):
                out.append((number, line[i:]))
                break
    return out


def c_prose(text: str) -> list[tuple[int, str]]:
    """(line, comment) of a C++/CUDA file: ``//`` and ``/* */`` comments outside string literals."""
    out, i, line, n = [], 0, 1, len(text)
    while i < n:
        ch = text[i]
        if ch == "\n":
            line += 1
        elif ch in "\"'":
            j = i + 1
            while j < n and text[j] != ch and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append((line, text[i:end]))
            i = end
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i)
            end = n if end < 0 else end + 2
            for k, piece in enumerate(text[i:end].split("\n")):
                out.append((line + k, piece))
            line += text[i:end].count("\n")
            i = end
            continue
        i += 1
    return out


def prose_of(path: str, text: str) -> list[tuple[int, str]]:
    if path.endswith(".md"):
        return list(enumerate(text.splitlines(), 1))
    if path.endswith(".py"):
        return python_prose(text)
    if path.endswith(".sh"):
        return shell_prose(text)
    return c_prose(text)


# -- which tokens are paths, and do they exist -------------------------------------------------


def _expand(token: str) -> list[str]:
    """Braces with commas give one token per choice; a template without a comma (a tag in braces)
    gives none."""
    m = re.search(r"\{([^{}]*)\}", token)
    if m is None:
        return [token]
    if "," not in m.group(1):
        return []
    return [p for alt in m.group(1).split(",") for p in _expand(token[: m.start()] + alt + token[m.end() :])]


def path_tokens(line: str) -> list[str]:
    """The repository paths a line of prose names (see the module's docstring)."""
    line = re.sub(r"\w+://\S+", " ", line)  # URLs
    line = re.sub(r"\]\(([^)#\s]*)(#[^)]*)?\)", r"] `\1` ", line)  # markdown links: their target
    quoted = [m.span() for m in re.finditer(r"`[^`]*`", line)]
    found = []
    for match in _TOKEN.finditer(line):
        in_backticks = any(a < match.start() < b for a, b in quoted)
        for token in _expand(match.group().rstrip(".,;:").lstrip(",;:")):
            token = token.rstrip(".,;:")
            if not token or re.search(r"[*<>$~%{}]", token) or token.startswith(("/", "-")):
                continue
            if EXTERNAL.search(token):
                continue
            top = token.split("/")[0]
            if "/" in token:
                if (token.startswith(("./", "../")) and token.endswith(EXTENSIONS + ("/",))) or (
                    top in TOP_LEVEL and (token.endswith(EXTENSIONS + ("/",)) or in_backticks)
                ):
                    found.append(token)
                elif token.endswith(EXTENSIONS):
                    found.append(token)
            elif token.endswith(BARE_EXTENSIONS) and len(token.split(".")[0]) > 0:
                found.append(token)
    return found


def path_problem(token: str, citing: str, files: set[str], dirs: set[str]) -> str | None:
    """Why ``token`` cited in file ``citing`` is not a repository path, or None when it is."""
    names = {p.rsplit("/", 1)[-1] for p in files}
    if "/" not in token:
        return None if token in names else "no file of the repository has this name"
    clean = token.rstrip("/")
    for base in ("", os.path.dirname(citing)):
        rel = os.path.normpath(os.path.join(base, clean))
        if rel == ".." or rel.startswith("../"):
            continue
        if rel in files or rel in dirs:
            return None
    outside = [os.path.normpath(os.path.join(b, clean)) for b in ("", os.path.dirname(citing))]
    if any(r.startswith("..") for r in outside):
        return "outside the repository: nothing in it may cite files outside it"
    return "no such file or folder in the repository"


def find_path_drift(texts: dict[str, str], files: list[str]) -> list[str]:
    """``file:line: `token`: why`` for every path named in ``texts`` ({path: text}) that is not a
    repository path of ``files``."""
    present = set(files)
    dirs = {str(p) for f in files for p in Path(f).parents if str(p) != "."}
    problems = []
    for citing, text in texts.items():
        for number, prose in prose_of(citing, text):
            for token in path_tokens(prose):
                why = path_problem(token, citing, present, dirs)
                if why:
                    problems.append(f"{citing}:{number}: `{token}`: {why}")
    return problems


def repository_texts(files: list[str]) -> dict[str, str]:
    return {f: (ROOT / f).read_text(errors="replace") for f in documents(files) + sources(files)}


# -- the API reference -------------------------------------------------------------------------


def public_objects() -> dict[str, object]:
    """{name as documented: object}: jax_cpgrad's ``__all__``, the public names of
    ``jax_cpgrad.attention`` and ``jax_cpgrad.launch``, and ``WorkspaceSpec``."""
    import jax_cpgrad

    out: dict[str, object] = {name: getattr(jax_cpgrad, name) for name in jax_cpgrad.__all__}
    for module_name in ("jax_cpgrad.attention", "jax_cpgrad.launch"):
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and getattr(v, "__module__", None) == module_name
        ]
        out.update({n: getattr(module, n) for n in names})
    out["WorkspaceSpec"] = importlib.import_module("jax_cpgrad.spec").WorkspaceSpec
    return out


def _documented_signatures(name: str, doc: str) -> list[str]:
    """The parameter lists of every ``name(...)`` in ``doc`` (not ``x.name(``), parentheses balanced."""
    found = []
    for m in re.finditer(rf"(?<![\w.]){re.escape(name)}\(", doc):
        depth, i = 1, m.end()
        while i < len(doc) and depth:
            depth += {"(": 1, ")": -1}.get(doc[i], 0)
            i += 1
        found.append(re.sub(r"\s+", " ", doc[m.end() : i - 1]))
    return found


def _parse_parameters(params: str) -> list[tuple[str, str, object]] | None:
    """[(name, kind, default)] of a documented parameter list, or None if it is not one."""
    try:
        fn = ast.parse(f"def f({params}): pass").body[0]
    except SyntaxError:
        return None
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    missing = inspect.Parameter.empty

    def default(node):
        if node is None:
            return missing
        try:
            return ast.literal_eval(node)
        except ValueError:
            return ast.unparse(node)

    positional = a.posonlyargs + a.args
    pos_defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [(p.arg, "positional", default(d)) for p, d in zip(positional, pos_defaults, strict=True)]
    if a.vararg:
        out.append((a.vararg.arg, "*args", missing))
    out += [(p.arg, "keyword", default(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        out.append((a.kwarg.arg, "**kwargs", missing))
    return out


def _real_parameters(obj) -> list[tuple[str, str, object]]:
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.VAR_POSITIONAL: "*args",
        inspect.Parameter.KEYWORD_ONLY: "keyword",
        inspect.Parameter.VAR_KEYWORD: "**kwargs",
    }
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        obj = obj.__init__
    params = inspect.signature(obj).parameters.values()
    return [(p.name, kinds[p.kind], p.default) for p in params if p.name != "self"]


def _show(params) -> str:
    marks = {"keyword": "keyword-only ", "*args": "*", "**kwargs": "**"}
    return ", ".join(
        f"{marks.get(kind, '')}{name}" + ("" if d is inspect.Parameter.empty else f"={d!r}")
        for name, kind, d in params
    )


def find_api_drift(doc: str, objects: dict[str, object]) -> list[str]:
    """What ``doc`` (the API reference) misses: a name, or a callable's signature as
    ``name(params)`` with exactly its parameters, their kinds and defaults."""
    problems = []
    for name, obj in objects.items():
        if not re.search(rf"`[^`\n]*(?<![\w]){re.escape(name)}(?![\w])[^`\n]*`", doc) and not (
            _documented_signatures(name, doc)
        ):
            problems.append(f"`{name}` is not in the API reference")
            continue
        if not callable(obj):
            continue
        real = _real_parameters(obj)
        written = [p for p in map(_parse_parameters, _documented_signatures(name, doc)) if p is not None]
        if not any(w == real for w in written):
            shown = "; ".join(f"{name}({_show(w)})" for w in written) or "no signature"
            problems.append(
                f"{name}: the API reference shows {shown}, but inspect.signature gives {name}({_show(real)})"
            )
    return problems


def find_member_drift(doc: str, cls) -> list[str]:
    """Public methods and properties of ``cls`` (and attributes its ``__init__`` sets) that
    ``doc`` does not name in backticks."""
    members = {n for n in vars(cls) if not n.startswith("_")}
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and not node.attr.startswith("_"):
                members.add(node.attr)
    quoted = " ".join(re.findall(r"`[^`]*`", doc))
    return [
        f"{cls.__name__}.{m} is not in the API reference"
        for m in sorted(members)
        if not re.search(rf"(?<![\w]){m}(?![\w])", quoted)
    ]


# -- the repository's documents ------------------------------------------------------------------


@pytest.fixture(scope="module")
def files():
    return repository_files()


def test_every_path_named_in_docs_comments_and_docstrings_exists(files):
    problems = find_path_drift(repository_texts(files), files)
    assert not problems, "paths that are not in the repository:\n" + "\n".join(problems)


def test_every_public_function_and_parameter_is_in_the_api_reference():
    doc = (ROOT / "docs" / "api.md").read_text()
    problems = find_api_drift(doc, public_objects())
    assert not problems, "docs/api.md is behind the code:\n" + "\n".join(problems)


def test_every_workspace_member_is_in_the_api_reference():
    from jax_cpgrad import Workspace

    doc = (ROOT / "docs" / "api.md").read_text()
    problems = find_member_drift(doc, Workspace)
    assert not problems, "\n".join(problems)


def test_every_choice_of_every_option_is_in_the_api_reference():
    """The values an option takes: the code's own lists of them, each backticked in docs/api.md."""
    from jax_cpgrad import launch, workspace
    from jax_cpgrad.attention import layer

    doc = (ROOT / "docs" / "api.md").read_text()
    choices = {
        "Workspace protocol": workspace.PROTOCOL_CHOICES,
        "Workspace on_timeout": workspace.ON_TIMEOUT_CHOICES,
        "Workspace handle_type": workspace.HANDLE_TYPES,
        "dot_product_attention implementation": [c for c in layer.IMPLEMENTATIONS if c is not None],
        "launch --devices": launch.DEVICE_CHOICES,
    }
    options = [o for a in launch._parser()._actions for o in a.option_strings if o not in ("-h", "--help")]
    quoted = " ".join(re.findall(r"`[^`]*`", doc))
    missing = [f"{where}: {c!r}" for where, values in choices.items() for c in values if str(c) not in quoted]
    missing += [
        f"python -m jax_cpgrad.launch {o}" for o in options if not re.search(rf"{o}(?![\w-])", quoted)
    ]
    assert not missing, "options or values docs/api.md does not name (in backticks):\n" + "\n".join(missing)


# -- the checkers themselves fail on planted drift ------------------------------------------------


def test_the_path_checker_fails_on_planted_wrong_paths(files):
    text = (
        "# Planted\n"
        "See `docs/api.md`, [the design](design.md#limitations) and ffi/vmm_memory.{h,cc}.\n"
        "The kernels are in `ffi/no_such_kernels.cu`; results in benchmarks/results/nothing.json.\n"
        "Machine notes: ../shared/KINDS.md and DEVICE.md; not paths: /usr/local/cuda, dK/dV, S/N,\n"
        "https://github.com/jax-ml/jax/tree/main/jax, build/wheel/{wheel_tag}, .whl/jax_cpgrad-*.whl.\n"
    )
    problems = find_path_drift({"docs/planted.md": text}, files)
    flagged = sorted(p.split("`")[1] for p in problems)
    assert flagged == [
        "../shared/KINDS.md",
        "DEVICE.md",
        "benchmarks/results/nothing.json",
        "ffi/no_such_kernels.cu",
    ], problems
    assert all(p.startswith(("docs/planted.md:3:", "docs/planted.md:4:")) for p in problems), problems
    assert "outside the repository" in next(p for p in problems if "KINDS" in p)


def test_the_path_checker_reads_comments_and_docstrings_not_code(files):
    source = (
        '"""Module docstring citing docs/gone.md."""\n'
        "x = 'docs/in_a_string_literal.md'  # a comment citing ffi/gone.h\n"
        "def f():\n"
        '    """See tests/test_gone.py."""\n'
    )
    shell = "echo docs/not_prose.md  # but this cites scripts/gone.sh\n"
    cpp = '// cites ffi/gone.cu\nconst char* s = "ffi/a_literal.h";  /* and\n   docs/gone2.md */\n'
    problems = find_path_drift({"tests/x.py": source, "scripts/x.sh": shell, "ffi/x.cc": cpp}, files)
    assert sorted(p.split(": `")[0] for p in problems) == [
        "ffi/x.cc:1",
        "ffi/x.cc:3",
        "scripts/x.sh:1",
        "tests/x.py:1",
        "tests/x.py:2",
        "tests/x.py:4",
    ], problems


def test_paths_resolve_against_the_citing_files_folder(files):
    assert not find_path_drift({"ffi/device/x.cuh": "// see ../fused_kernels.h and signal.cuh\n"}, files)
    assert find_path_drift({"ffi/device/x.cuh": "// see ../../../outside.h\n"}, files)


def test_the_api_checker_fails_on_a_planted_undocumented_parameter():
    def planted(query, *, axis_name, workspace=None, new_option=3):
        """A public function that grew an option the reference does not show."""

    doc = "- `planted(query, *, axis_name, workspace=None)`: one rank's part.\n- `HAS_IT`: a flag.\n"
    problems = find_api_drift(doc, {"planted": planted, "HAS_IT": True, "MISSING": False})
    assert len(problems) == 2, problems
    assert "new_option=3" in problems[0] and problems[1] == "`MISSING` is not in the API reference"
    # A wrong default is drift too; the right signature passes.
    assert find_api_drift(doc.replace("None)", "None, new_option=2)"), {"planted": planted})
    assert not find_api_drift(doc.replace("None)", "None, new_option=3)"), {"planted": planted})
