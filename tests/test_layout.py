"""The layout shows the flow, and keeps to it: no import cycles between autohc's modules (lazy
imports included), no module reaching into another's private names, and every knob a search
space declares changes the generated C."""
import ast
import dataclasses
import itertools
from pathlib import Path

import pytest

from autohc.kernels import family
from autohc.kernels.eltwise import KERNELS, EltwiseParams
from autohc.kernels.eltwise.codegen import render_eltwise
from autohc.kernels.gemm.codegen import render_gemm, render_gemm_objects
from autohc.kernels.gemm.params import INSTANCE_FIELDS, GemmParams, ParamError, default_params
from autohc.kernels.isa import ISAS
from autohc.tune.space import as_suggestions, isa_entries, load_space, suggest_params

PKG = Path(__import__("autohc").__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mods):
    """{module: {(imported module, name or None)}} of every import statement, lazy ones too."""
    out = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {(a.name, None) for a in node.names if a.name.startswith("autohc")}
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node)
                if target.startswith("autohc"):
                    for a in node.names:
                        sub = f"{target}.{a.name}"
                        found.add((sub, None) if sub in mods else (target, a.name))
        out[mod] = found
    return out


def test_no_import_cycles():
    mods = _modules()
    graph = {m: {t for t, _ in imps if t in mods and t != m} for m, imps in _imports(mods).items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_private_names():
    mods = _modules()
    bad = [f"{m} imports {name} from {t}" for m, imps in _imports(mods).items()
           for t, name in imps if name and name.startswith("_") and not name.startswith("__")]
    for mod, path in mods.items():            # module._name attribute reads
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(mod, path.name == "__init__.py", node)
                for a in node.names:
                    if f"{target}.{a.name}" in mods and f"{target}.{a.name}" != mod:
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in aliases and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                bad.append(f"{mod} reads {aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_declarations_come_from_the_source():
    src = render_gemm(default_params("avx2", 2))
    decls = family.exported_declarations(src)
    for fn in ("_new(", "_trim(", "_gemm(", "_gemm_bias(", "_gemm_batched(", "_bind(", "_threads(", "_isa_supported(",
               "_skinny_unit("):
        assert fn in decls
    assert decls.count(";") == 9
    with pytest.raises(ValueError):
        family.exported_declarations("int f(void) { return 0; }")


class _Trial:
    """An Optuna trial stand-in that answers from a fixed dict (the tuner's own suggestion
    code turns it into parameters)."""

    def __init__(self, values):
        self.values = values

    def suggest_categorical(self, name, choices):
        return self.values[name]


def _gemm_variants(isa, threads=4):
    base = as_suggestions(default_params(isa, threads), isa)
    space = isa_entries(load_space("gemm"), isa)
    knobs = {**{k: list(v["values"]) for k, v in space.items()},
             "geometry": ["4x1x1", "1x2x2", "2x2x1"]}
    for knob, values in knobs.items():
        rendered = {}
        for v in values:
            try:
                p = suggest_params(_Trial({**base, knob: v}), isa, threads)
            except ParamError:
                continue
            # what runs: the library and what it links, and the instance's run-time blocks and ways
            rendered[p] = (render_gemm(p) + "".join(render_gemm_objects(p).values()), p.instance_args())
            if len(rendered) == 2:
                break
        yield knob, rendered


@pytest.mark.parametrize("isa", list(ISAS))
def test_every_gemm_knob_changes_the_c(isa):
    for knob, rendered in _gemm_variants(isa):
        assert len(rendered) == 2, f"gemm/{isa}: fewer than two valid values of {knob}"
        a, b = rendered.values()
        assert a != b, f"gemm/{isa}: knob {knob} declared in the search space, but the C is the same"
        if knob in INSTANCE_FIELDS or knob == "geometry":     # (an instance's: one library for both)
            assert a[0] == b[0], f"gemm/{isa}: knob {knob} is an instance's, but it changes the library's C"


@pytest.mark.parametrize("isa", list(ISAS))
def test_every_eltwise_knob_changes_the_c(isa):
    space = {k: list(v["values"]) for k, v in isa_entries(load_space("eltwise"), isa).items()}
    base = EltwiseParams(isa=isa, vl=space["vl"][0])
    for kernel, knobs in KERNELS.items():
        for knob in knobs:
            if knob not in space:           # e.g. streaming stores: x86 back-ends only
                continue
            a, b = itertools.islice((v for v in space[knob]), 2)
            ra = render_eltwise(kernel, EltwiseParams(**{**base.to_dict(), knob: a}))
            rb = render_eltwise(kernel, EltwiseParams(**{**base.to_dict(), knob: b}))
            assert ra != rb, f"eltwise/{isa}/{kernel}: knob {knob} is declared but the C is the same"


def test_gemm_params_read_earlier_registries():
    """Registries written before the loops were renamed still load (clusters/tm/tn, pin,
    spin_us), as the same kernel."""
    old = {**default_params("avx2", 2).to_dict()}
    old.update(clusters=old.pop("jc_ways"), tm=old.pop("ic_ways"), tn=old.pop("jr_ways"),
               pin=True, spin_us=200)
    assert GemmParams.from_dict(old) == default_params("avx2", 2)
    assert EltwiseParams.from_dict({"isa": "avx2", "vl": 8, "unroll": 2, "nt": True}).stream_stores


def test_every_family_implements_the_interface():
    from autohc.kernels.attention.family import ATTENTION
    from autohc.kernels.eltwise.family import ELTWISE
    from autohc.kernels.gemm.family import GEMM
    for fam in (GEMM, ELTWISE, ATTENTION):
        assert isinstance(fam, family.KernelFamily)
        for kernel in fam.kernels():
            p = fam.default("avx2", 2)
            assert isinstance(p, fam.params_type)
            src = fam.render(p, kernel)
            assert fam.declaration(p, kernel) == family.exported_declarations(src)
            # (fields, not to_dict(): that leaves out fields added later, at their defaults)
            assert set(fam.knobs(kernel)) <= {f.name for f in dataclasses.fields(p)}
    assert GEMM.problem_key("NT", 1152, 4608, 1400, 2) == "gemm/NT/K1152/N4608/M1024/t2"
    assert ELTWISE.problem_key("softmax_fwd", 2) == "eltwise/softmax_fwd/t2"
    assert ATTENTION.problem_key("attention", 2) == "attention/attention/t2"
    space = {k for k in isa_entries(load_space("eltwise"), "avx512")}
    assert space <= {k for ks in KERNELS.values() for k in ks}     # no knob no kernel reads
