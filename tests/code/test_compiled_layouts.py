"""Each ``.pxd`` (the compiled build's layout of a module, see setup.py) declares exactly the
fields its Python class has: ``__slots__``, a dataclass's fields in order, or what ``__init__``
assigns. A field missing from one side breaks only the compiled build (an AttributeError at run
time, or a field that silently never exists), so this is checked, not kept by hand."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "sidecar"
PXDS = sorted(p for p in ROOT.rglob("*.pxd") if p.with_suffix(".py").exists())


def pxd_classes(text: str) -> dict[str, list[str]]:
    """``cdef class Name:`` -> its ``cdef public`` (or plain ``cdef``) field names, in order."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        head = re.match(r"cdef class (\w+)\s*(\(.*\))?\s*:", line)
        if head:
            current = out.setdefault(head.group(1), [])
            continue
        if current is None or not line.startswith("    "):
            if line and not line.startswith(" "):
                current = None
            continue
        field = re.match(r"    cdef (?:public |readonly )?(.+)$", line.rstrip())
        if field and "(" not in line and not line.lstrip().startswith(("cdef class", "cdef inline")):
            first, *rest = field.group(1).split(",")  # "unsigned long long a, b": the type, then names
            current.extend([first.split()[-1], *(n.strip() for n in rest)])
    return out


def py_fields(cls: ast.ClassDef) -> tuple[str, list[str]]:
    """How the class declares its fields, and them."""
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__slots__" for t in node.targets):
            return "__slots__", list(ast.literal_eval(node.value))
    if any(getattr(d, "id", getattr(getattr(d, "func", None), "id", "")) == "dataclass" for d in cls.decorator_list):
        return "dataclass", [
            n.target.id
            for n in cls.body
            if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)
        ]
    names: list[str] = []
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for sub in ast.walk(node):
                targets = (
                    sub.targets
                    if isinstance(sub, ast.Assign)
                    else [sub.target]
                    if isinstance(sub, (ast.AnnAssign, ast.AugAssign))
                    else []
                )
                for t in targets:
                    for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if (
                            isinstance(el, ast.Attribute)
                            and getattr(el.value, "id", "") == "self"
                            and el.attr not in names
                        ):
                            names.append(el.attr)
    return "__init__", names


@pytest.mark.parametrize("pxd", PXDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_compiled_layout_matches_its_class(pxd: Path) -> None:
    declared = pxd_classes(pxd.read_text(encoding="utf-8"))
    tree = ast.parse(pxd.with_suffix(".py").read_text(encoding="utf-8"))
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for name, fields in declared.items():  # (a layout may only type module functions: nothing to match)
        assert name in classes, f"{pxd.name} declares class {name}, which {pxd.with_suffix('.py').name} lacks"
        how, expected = py_fields(classes[name])
        if how == "dataclass":
            assert fields == expected, f"{name}: pxd {fields} != dataclass fields in order {expected}"
        else:
            assert sorted(fields) == sorted(expected), (
                f"{name}: pxd fields {sorted(set(fields) - set(expected))} not in {how}, "
                f"{how} {sorted(set(expected) - set(fields))} not in pxd"
            )


def test_the_check_reads_layouts_and_finds_a_mismatch() -> None:
    layout = pxd_classes("cdef class A:\n    cdef public object x, y\n    cdef public long z\n    cpdef f(self)\n")
    assert layout == {"A": ["x", "y", "z"]}
    cls = ast.parse("class A:\n    __slots__ = ('x', 'y')\n").body[0]
    assert isinstance(cls, ast.ClassDef)
    assert py_fields(cls) == ("__slots__", ["x", "y"]) and sorted(layout["A"]) != ["x", "y"]


# -- module constants declared as C globals --------------------------------------------------
# A layout may declare module-level names (``cdef long DONE``): compiled, they become C globals,
# read without a dict lookup, but they leave the module's namespace. So each must be assigned at
# the module level of its .py (an import or an assignment: otherwise the compiled build reads 0
# or None), and no other module may import it from there or read it as an attribute (that fails
# in the compiled build only).

GLOBAL_DECL = re.compile(
    r"cdef (?!class |extern |struct |enum |inline |public |readonly )([\w ]+?) (\w+(?:, *\w+)*)\s*(#.*)?$"
)
SOURCES = sorted(p for top in ("sidecar", "tests", "bench") for p in (ROOT.parent / top).rglob("*.py"))


@functools.cache
def source(path: Path) -> tuple[str, list[ast.ImportFrom]]:
    """A module's text and its ``from ... import`` statements (read once for every layout)."""
    text = path.read_text(encoding="utf-8")
    return text, [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom)]


def pxd_globals(text: str) -> set[str]:
    """The module-level names a layout declares as C variables."""
    names: set[str] = set()
    for line in text.splitlines():
        m = GLOBAL_DECL.match(line.rstrip())
        if m and "(" not in line:
            names.update(n.strip() for n in m.group(2).split(","))
    return names


def module_assigned(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (imports and assignments, tuple targets included)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(e.id for e in ast.walk(t) if isinstance(e, ast.Name))
    return names


def module_name(pxd: Path) -> str:
    return ".".join(pxd.with_suffix("").relative_to(ROOT.parent).parts)


WITH_GLOBALS = [p for p in PXDS if pxd_globals(p.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("pxd", WITH_GLOBALS, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_c_global_is_set_by_its_module_and_read_by_no_other(pxd: Path) -> None:
    declared = pxd_globals(pxd.read_text(encoding="utf-8"))
    unset = declared - module_assigned(ast.parse(pxd.with_suffix(".py").read_text(encoding="utf-8")))
    assert not unset, f"{pxd.name} declares {sorted(unset)}, which its module never sets at its top level"
    module = module_name(pxd)
    short = module.rsplit(".", 1)[1]
    for path in SOURCES:
        if path == pxd.with_suffix(".py"):
            continue
        text, imports = source(path)
        for node in imports:
            if node.module == module:
                taken = declared & {a.name for a in node.names}
                assert not taken, f"{path.name} imports {sorted(taken)} from {module}: C globals once compiled"
        read = {n for n in declared if re.search(rf"\b{short}\.{n}\b", text)}
        assert not read, f"{path.name} reads {sorted(read)} as attributes of {module}: C globals once compiled"


def test_the_global_check_sees_declarations_and_bindings() -> None:
    text = "cdef long A, B  # why\ncdef object f\ncdef class C:\n    cdef public long x\ncpdef g(long a)\n"
    assert pxd_globals(text) == {"A", "B", "f"}
    tree = ast.parse("from time import perf_counter as f\nA, B = range(2)\n")
    assert module_assigned(tree) == {"f", "A", "B"}
    assert module_name(ROOT / "engine" / "fast_exchange.pxd") == "sidecar.engine.fast_exchange"
