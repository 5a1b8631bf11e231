"""The CPUs a recipe names for serving (`deploy.cpu`, `optimize --for`), and what each choice the export makes for
the host may be for them: the names, what each implies, and the rules (``export/deploy_hosts.py`` applies them).

Pure data and rules, in the kernel so the recipe's schema and the deployment record can read them::

    >>> sorted(cpu_flags("avx512_bf16"))
    ['avx2', 'avx512_bf16', 'avx512_vnni', 'avx512f', 'fma']
    >>> int8_form_for(["avx2", "avx512_vnni"])[0]
    'u8s8'
    >>> int8_form_for(["avx512_vnni", "amx_int8"])[0] is None   # every one has VNNI: `auto` times the forms
    True
"""

from __future__ import annotations

from typing import Any

#: The flags each known name implies (keys: ``runtime.host.ISA_FLAGS``, tested to match). ARM names stand for an
#: aarch64 CPU, every other for an x86-64 one.
IMPLIED: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma"),
    "fma": ("fma",),
    "avx512f": ("avx2", "fma", "avx512f"),
    "avx512_vnni": ("avx2", "fma", "avx512f", "avx512_vnni"),
    "avx_vnni": ("avx2", "fma", "avx_vnni"),
    "avx512_bf16": ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"),
    "amx_bf16": ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"),
    "amx_int8": ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"),
    "amx_tile": ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"),
    "asimd": ("asimd",),
    "sve": ("asimd", "sve"),
}
ARM_FLAGS = ("asimd", "sve")
#: Flags with which x86 int8 kernels multiply u8 by s8 straight into int32 (no int16 pair sums).
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
#: Flags with which OpenVINO's CPU default computes float parts in bf16.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: The INT8 form exact on every CPU.
PORTABLE_FORM = "u8s8"


def known_names() -> str:
    return ", ".join(IMPLIED)


def cpu_flags(entry: str) -> frozenset[str]:
    """The ISA flags of the CPU ``entry`` names (``NAME`` or ``NAME+NAME``); ValueError naming the known ones."""
    names = [n.strip().lower() for n in str(entry).split("+")]
    unknown = [n for n in names if n not in IMPLIED]
    if unknown or not names:
        raise ValueError(f"{', '.join(map(repr, unknown or [entry]))} is not a known CPU instruction set; known: "
                         f"{known_names()} (join several with +, e.g. avx2+avx_vnni)")
    arm = {n in ARM_FLAGS for n in names}
    if len(arm) > 1:
        raise ValueError(f"{entry!r} mixes ARM ({', '.join(ARM_FLAGS)}) and x86 instruction sets: name one CPU per entry")
    return frozenset(f for n in names for f in IMPLIED[n])


def canonical(entry: str) -> str:
    """``entry`` as recorded: lower case, its names in the known order, joined by +."""
    names = {n.strip().lower() for n in str(entry).split("+")}
    return "+".join(n for n in IMPLIED if n in names)


def normalise(value: Any) -> list[str] | None:
    """The recipe's ``deploy.cpu`` (a list, or one comma-separated text as ``--for`` gives it) as canonical
    names; None stays None (no CPU named: portable). ValueError for an unknown name, an empty list or a repeat."""
    if value is None:
        return None
    items = [v for v in value.split(",")] if isinstance(value, str) else list(value)
    if not items or any(not str(v).strip() for v in items):
        raise ValueError("name at least one CPU (e.g. [avx2, avx512_vnni]), or leave `deploy.cpu` out for artifacts "
                         "exact on every CPU")
    out = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"{item!r} is not a CPU name; known: {known_names()}")
        cpu_flags(item)
        name = canonical(item)
        if name in out:
            raise ValueError(f"{name!r} is listed twice")
        out.append(name)
    return out


def host_of(entry: str) -> dict[str, Any]:
    """A ``runtime.host_info()``-shaped host for the CPU ``entry`` names (what ``forms.exact_encodings`` reads)."""
    flags = cpu_flags(entry)
    arch = "aarch64" if flags & set(ARM_FLAGS) else "x86_64"
    return {"cpu": {"model": entry, "arch": arch, "isa": sorted(flags)}}


def exact_int8(entry: str) -> bool:
    """Whether every INT8 form is exact on this CPU (VNNI/AMX, or not x86)."""
    flags = cpu_flags(entry)
    return bool(flags & set(ARM_FLAGS) or flags & set(VNNI_FLAGS))


def computes_bf16(entry: str) -> bool:
    return bool(cpu_flags(entry) & set(BF16_FLAGS))


def int8_form_for(hosts: list[str] | None) -> tuple[str | None, str]:
    """``(form to pin, why)`` for a target's ``form: auto`` serving ``hosts``: ``u8s8`` unless every named CPU runs
    every form exactly; None (leave ``auto`` to time the forms exact here) when they all do."""
    if not hosts:
        return PORTABLE_FORM, ("no serving CPU named (`deploy.cpu`, `optimize --for`): the form exact on every x86 CPU, "
                               "VNNI or not; name only VNNI/AMX CPUs to let `form: auto` time the faster forms")
    short = [h for h in hosts if not exact_int8(h)]
    if short:
        return PORTABLE_FORM, (f"served on {', '.join(short)}, an x86 CPU without VNNI (u8 x s8 products added in int16 "
                               "pairs): the one form exact there")
    return None, f"every serving CPU ({', '.join(hosts)}) has VNNI/AMX or is not x86: every form is exact on them"


def int8_hint_for(hosts: list[str] | None) -> tuple[str | None, str]:
    """``(hint to pin, why)`` for the openvino target's ``int8_hint: auto``: ``f32`` when CPUs are named and none
    computes bf16 (OpenVINO's default is f32 there); None otherwise (the hint is measured as before)."""
    if hosts and not any(computes_bf16(h) for h in hosts):
        return "f32", (f"no serving CPU ({', '.join(hosts)}) computes bf16: OpenVINO's default is f32 on them, "
                       "so the bf16 default of this host is not timed")
    return None, ""
