"""MLX's own Metal text, on Linux: the source ``mx.fast.metal_kernel`` generates
for one call, and the part of MLX's JIT preamble that goes in front of it.

MLX's generator lives in its common backend (mlx/backend/common/metal_kernel.cpp),
so the Linux wheel has it. A normal call of a Metal kernel throws "No Metal
back-end" here, but while ``mx.export_function`` traces a function the kernel
object builds its source anyway, and with ``verbose=True`` prints it to the C++
stdout. ``generated_source`` captures that print: the text is MLX's, never a
reimplementation of its generator.

The text depends on the kernel's name, header, source, input/output names and
template arguments, and per input on its dtype, whether it is 0-d and whether it
has fewer than 8 elements (then MLX passes it in ``constant`` memory), per output
on its dtype (``write_signature`` in MLX): ``text_key`` is exactly that, so one
capture serves every call with the same key.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

#: MLX passes an input with fewer elements than this in `constant` memory.
MAX_CONSTANT_ARRAY_SIZE = 8

#: The thread attributes MLX can add to a signature (metal_kernel.cpp), by type.
METAL_ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint", "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3", "grid_origin": "uint3", "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint", "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint", "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint", "thread_index_in_quadgroup": "uint",
    "thread_index_in_simdgroup": "uint", "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3", "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3", "threads_per_simdgroup": "uint", "threads_per_threadgroup": "uint3",
}

TemplateArg = Tuple[str, object]
TextKey = tuple


class MetalTextError(RuntimeError):
    """MLX's generated text is not what the emulator can check (or MLX did not print it)."""


def _template_value(value) -> object:
    return str(value) if isinstance(value, mx.Dtype) else value


def text_key(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
             header: str, atomic_outputs: bool, inputs: Sequence[mx.array],
             output_dtypes: Sequence[mx.Dtype], template: Sequence[TemplateArg]) -> TextKey:
    """Everything MLX's generated text depends on, for one call."""
    return (name, tuple(input_names), tuple(output_names), source, header, atomic_outputs,
            tuple((str(a.dtype), a.ndim == 0, a.size < MAX_CONSTANT_ARRAY_SIZE) for a in inputs),
            tuple(str(d) for d in output_dtypes),
            tuple((n, _template_value(v)) for n, v in template))


def generated_source(real_metal_kernel, name: str, input_names: Sequence[str],
                     output_names: Sequence[str], source: str, header: str,
                     atomic_outputs: bool, inputs: Sequence[mx.array],
                     output_shapes: Sequence[Sequence[int]], output_dtypes: Sequence[mx.Dtype],
                     grid, threadgroup, template: Sequence[TemplateArg]) -> str:
    """The Metal source MLX generates for this call, printed by MLX itself."""
    kernel = real_metal_kernel(name=name, input_names=list(input_names),
                               output_names=list(output_names), source=source, header=header,
                               ensure_row_contiguous=False, atomic_outputs=atomic_outputs)

    def traced(*args):
        return kernel(inputs=list(args), output_shapes=[tuple(s) for s in output_shapes],
                      output_dtypes=list(output_dtypes), grid=tuple(grid),
                      threadgroup=tuple(threadgroup), template=list(template) or None,
                      verbose=True)

    with tempfile.TemporaryDirectory(prefix="muser_kv_metal_text_") as tmp:
        printed = _capture_stdout(lambda: mx.export_function(str(Path(tmp) / "k.mlxfn"), traced,
                                                             *inputs))
    return _extract(printed, name)


def _capture_stdout(fn) -> str:
    """What ``fn`` writes to file descriptor 1 (MLX prints with std::cout)."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            fn()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode()


def _extract(printed: str, name: str) -> str:
    lead = f"Generated source code for `{name}`:\n```\n"
    start = printed.find(lead)
    end = printed.rfind("\n```\n")
    if start < 0 or end < start:
        raise MetalTextError(f"MLX printed no source for {name!r}; it printed:\n{printed[:2000]}")
    return printed[start + len(lead):end]


# -- the generated signature ----------------------------------------------------

@dataclass(frozen=True)
class Param:
    """One kernel parameter as MLX wrote it."""

    kind: str  # "input", "shape", "strides", "ndim", "output", "attribute"
    name: str  # the parameter name
    ctype: str  # element type (input/output), "int"/"int64_t" (shape info), "uint3"/"uint"
    space: str  # "device", "constant" or "" (attributes)
    ref: bool  # `&` (a 0-d input, or _ndim) rather than `*`
    buffer: Optional[int]  # [[buffer(i)]]
    of: str = ""  # the input a shape/strides/ndim parameter belongs to


@dataclass(frozen=True)
class Signature:
    name: str  # the kernel function's name
    params: Tuple[Param, ...]
    template_args: str  # "<float, float16_t, 2, 128, 0>" or ""


_INPUT = re.compile(r"const (device|constant) (\w+)(\*|&) (\w+) \[\[buffer\((\d+)\)\]\]")
_OUTPUT = re.compile(r"device (atomic<)?(\w+)>?\* (\w+) \[\[buffer\((\d+)\)\]\]")
_ATTRIBUTE = re.compile(r"(uint3|uint) (\w+) \[\[(\w+)\]\]")
_HEAD = re.compile(r"^\[\[kernel\]\] void (\w+)\($", re.M)
_INSTANTIATION = re.compile(
    r'^template \[\[host_name\("(\w+)"\)\]\] \[\[kernel\]\] decltype\((\w+)(<[^;]*>)\) (\w+)(<[^;]*>);$',
    re.M)
_ANY_ATTRIBUTE = re.compile(r"\[\[\s*([A-Za-z_]\w*)\s*(\([^\]]*\))?\s*\]\]")


def parse_signature(text: str, input_names: Sequence[str], output_names: Sequence[str]) -> Signature:
    """The parameter list of MLX's text, checked against MLX's buffer order:
    each input, then its _shape / _strides / _ndim, then the outputs, then the
    thread attributes; buffers numbered 0, 1, 2, ... in that order."""
    heads = _HEAD.findall(text)
    if len(heads) != 1:
        raise MetalTextError(f"expected one [[kernel]] function, found {len(heads)}")
    func = heads[0]
    lines = text[text.index(f"[[kernel]] void {func}(\n") + len(f"[[kernel]] void {func}(\n"):]
    params: List[Param] = []
    for raw in lines.split("\n"):
        line = raw.strip()
        last = line.endswith(") {")
        item = line[:-3] if last else line.rstrip(",")
        if not last and not line.endswith(","):
            raise MetalTextError(f"{func}: unexpected line in the parameter list: {raw!r}")
        params.append(_param(func, item, input_names, output_names))
        if last:
            break
    _check_order(func, params, input_names, output_names)
    inst = _INSTANTIATION.findall(text)
    template_args = ""
    if inst:
        host, a, args_a, b, args_b = inst[0]
        if len(inst) != 1 or not (host == a == b == func) or args_a != args_b:
            raise MetalTextError(f"{func}: unexpected explicit instantiation {inst}")
        template_args = args_a
    return Signature(func, tuple(params), template_args)


def _param(func: str, item: str, input_names, output_names) -> Param:
    m = _INPUT.fullmatch(item)
    if m:
        space, ctype, ref, name, buf = m.groups()
        for suffix, kind in (("_shape", "shape"), ("_strides", "strides"), ("_ndim", "ndim")):
            if name.endswith(suffix) and name[:-len(suffix)] in input_names:
                return Param(kind, name, ctype, space, ref == "&", int(buf), name[:-len(suffix)])
        if name not in input_names:
            raise MetalTextError(f"{func}: parameter {name!r} is no input")
        return Param("input", name, ctype, space, ref == "&", int(buf))
    m = _OUTPUT.fullmatch(item)
    if m:
        atomic, ctype, name, buf = m.groups()
        if atomic:
            raise MetalTextError(f"{func}: atomic outputs are not emulated")
        if name not in output_names:
            raise MetalTextError(f"{func}: parameter {name!r} is no output")
        return Param("output", name, ctype, "device", False, int(buf))
    m = _ATTRIBUTE.fullmatch(item)
    if m:
        ctype, name, attr = m.groups()
        if name != attr or METAL_ATTRIBUTES.get(attr) != ctype:
            raise MetalTextError(f"{func}: unknown thread attribute {item!r}")
        return Param("attribute", name, ctype, "", False, None)
    raise MetalTextError(f"{func}: cannot read parameter {item!r}")


def _check_order(func, params: Sequence[Param], input_names, output_names) -> None:
    buffers = [p.buffer for p in params if p.buffer is not None]
    if buffers != list(range(len(buffers))):
        raise MetalTextError(f"{func}: buffers are not numbered 0..{len(buffers) - 1}: {buffers}")
    # The order write_signature emits: each input followed by its own shape,
    # strides, ndim (each optional, in that order); the outputs; the attributes.
    expected: List[Tuple[str, str]] = []
    rest = list(params)
    for name in input_names:
        expected.append(("input", name))
        for kind in ("shape", "strides", "ndim"):
            if any(p.kind == kind and p.of == name for p in rest):
                expected.append((kind, name))
    expected += [("output", n) for n in output_names]
    expected += [("attribute", p.name) for p in params if p.kind == "attribute"]
    got = [(p.kind, p.of or p.name) for p in params]
    if got != expected:
        raise MetalTextError(f"{func}: parameters are not in MLX's order:\n  got {got}\n  "
                             f"expected {expected}")


def check_attributes(text: str) -> None:
    """clang ignores attributes it does not know; MSL does not. Every
    ``[[...]]`` in the text must be one MLX writes: kernel, buffer(i),
    host_name("..."), or a thread attribute."""
    for name, arg in _ANY_ATTRIBUTE.findall(text):
        if name == "kernel" and not arg:
            continue
        if name == "buffer" and re.fullmatch(r"\(\d+\)", arg or ""):
            continue
        if name == "host_name" and re.fullmatch(r'\("\w+"\)', arg or ""):
            continue
        if name in METAL_ATTRIBUTES and not arg:
            continue
        raise MetalTextError(f"attribute [[{name}{arg}]] is not one the emulator accepts")


def for_clang(text: str) -> str:
    """MLX's text with the two attribute lists of the explicit instantiation
    removed (C++ rejects attributes there); nothing else changes."""
    out, n = _INSTANTIATION.subn(lambda m: f"template decltype({m[2]}{m[3]}) {m[4]}{m[5]};", text)
    if n > 1:
        raise MetalTextError(f"{n} explicit instantiations; MLX writes at most one")
    return out


# -- the JIT preamble ------------------------------------------------------------

def mlx_kernel_headers() -> Path:
    """The wheel's copy of MLX's Metal kernel headers."""
    root = Path(mx.__file__).resolve().parent / "include"
    path = root / "mlx" / "backend" / "metal" / "kernels"
    if not (path / "utils.h").exists():
        raise MetalTextError(f"MLX's Metal headers are not in the wheel at {path}")
    return path


def mlx_include_root() -> Path:
    return Path(mx.__file__).resolve().parent / "include"


#: utils.h's includes, in the order MLX's make_compiled_preamble.sh expands them.
FULL_PREAMBLE = ("bf16.h", "bf16_math.h", "complex.h", "defines.h", "logging.h", "utils.h")
#: What the emulator prepends: whole files where the shim can compile them.
USED_PREAMBLE = ("bf16.h", "defines.h")


def _expanded(name: str) -> str:
    """One header as MLX's preamble script copies it: its `#include "...h"` and
    `#pragma once` lines dropped, everything else verbatim."""
    lines = (mlx_kernel_headers() / name).read_text().splitlines()
    kept = [ln for ln in lines
            if not re.search(r'#include ".*.h"', ln) and "#pragma once" not in ln]
    return f'#line 1 "mlx/backend/metal/kernels/{name}"\n' + "\n".join(kept) + "\n"


def jit_preamble() -> str:
    """The part of MLX's JIT preamble (``metal::utils()``) the emulator puts in
    front of the generated text: bf16.h and defines.h whole, and utils.h's
    ``typedef half float16_t;``. bf16_math.h, complex.h, logging.h and the rest
    of utils.h need the MSL the shim does not model (address-space-qualified
    member functions, <metal_stdlib>'s math and simd functions); the kernels
    use none of it, and ``preamble_identifiers`` guards against collisions."""
    typedef = "typedef half float16_t;"
    utils = (mlx_kernel_headers() / "utils.h").read_text()
    if typedef not in utils.splitlines():
        raise MetalTextError(f"utils.h in the wheel no longer has {typedef!r}")
    return "".join(_expanded(n) for n in USED_PREAMBLE) + \
        f'#line 13 "mlx/backend/metal/kernels/utils.h"\n{typedef}\n'


def preamble_identifiers() -> Dict[str, str]:
    """Every identifier in MLX's full JIT preamble, with the header it is in."""
    out: Dict[str, str] = {}
    for name in FULL_PREAMBLE:
        text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", (mlx_kernel_headers() / name).read_text(), flags=re.S)
        for ident in re.findall(r"[A-Za-z_]\w*", text):
            out.setdefault(ident, name)
    return out
