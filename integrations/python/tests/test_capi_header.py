"""The ctypes declarations in zoe/_capi.py against integrations/c/include/zoe.h: every function
declared, the same argument count, and each declaration's comment quoting the header's
prototype."""

import os
import re

from zoe import _capi

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "..", "..", "c", "include", "zoe.h")
CAPI = os.path.join(HERE, "..", "zoe", "_capi.py")


def _normalise(prototype):
    """One spacing for a C prototype: single spaces, none inside parentheses or before ';'."""
    text = " ".join(prototype.split())
    text = re.sub(r"\(\s+", "(", text)
    text = re.sub(r"\s+\)", ")", text)
    text = re.sub(r"\s+([,;])", r"\1", text)
    return text


def header_prototypes():
    """{name: normalised prototype} for every ZOE_API function of zoe.h."""
    text = open(HEADER, encoding="utf-8").read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    found = {}
    for match in re.finditer(r"ZOE_API\s+([^;]*?\b(zoe_\w+)\s*\([^;]*?\)\s*;)", text):
        found[match.group(2)] = _normalise(match.group(1))
    return found


def quoted_prototypes():
    """{name: normalised prototype} from the comment block above each _declare in _capi.py."""
    lines = open(CAPI, encoding="utf-8").read().splitlines()
    found = {}
    for index, line in enumerate(lines):
        match = re.match(r"(zoe_\w+) = _declare\(", line)
        if not match:
            continue
        comment = []
        cursor = index - 1
        while cursor >= 0 and lines[cursor].startswith("#"):
            comment.insert(0, lines[cursor][1:])
            cursor -= 1
        found[match.group(1)] = _normalise(" ".join(comment))
    return found


def argument_count(prototype):
    inside = prototype[prototype.index("(") + 1 : prototype.rindex(")")].strip()
    return 0 if inside in ("", "void") else inside.count(",") + 1


def test_header_is_parsed():
    prototypes = header_prototypes()
    text = open(HEADER, encoding="utf-8").read()
    assert len(prototypes) == len(re.findall(r"^ZOE_API ", text, flags=re.M))
    assert prototypes["zoe_engine_create"] == (
        "zoe_status zoe_engine_create(const char* config_json, zoe_engine** out);"
    )


def test_every_function_is_declared():
    missing = sorted(set(header_prototypes()) - set(_capi.DECLARATIONS))
    extra = sorted(set(_capi.DECLARATIONS) - set(header_prototypes()))
    assert missing == [], f"declared in zoe.h but not in _capi.py: {missing}"
    assert extra == [], f"declared in _capi.py but not in zoe.h: {extra}"


def test_argument_counts_match():
    for name, prototype in header_prototypes().items():
        declared = len(_capi.DECLARATIONS[name].argtypes)
        assert declared == argument_count(prototype), f"{name}: {prototype}"


def test_return_types_match():
    for name, prototype in header_prototypes().items():
        returns = prototype.split(name)[0].strip()
        restype = _capi.DECLARATIONS[name].restype
        expected = {"zoe_status": _capi.zoe_status, "void": None, "const char*": _capi.c_char_p}
        assert restype is expected[returns], f"{name} returns {returns}"


def test_quoted_prototypes_match_the_header():
    quoted = quoted_prototypes()
    for name, prototype in header_prototypes().items():
        assert quoted.get(name) == prototype, f"comment above {name} in _capi.py"


SIZED_STRUCTS = ("zoe_tensor_desc", "zoe_hyper_params", "zoe_step_result", "zoe_speculation_stats",
                 "zoe_collectives")


def header_struct_fields(struct):
    """The member names of ``typedef struct <struct> {...}`` in zoe.h, in order (a function
    pointer member ``int (*name)(...)`` by its name)."""
    text = open(HEADER, encoding="utf-8").read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (struct, struct), text, flags=re.S)
    fields = []
    for decl in body.group(1).split(";"):
        if not decl.strip():
            continue
        pointer = re.search(r"\(\*\s*(\w+)\s*\)", decl)
        fields.append(pointer.group(1) if pointer else re.findall(r"(\w+)\s*$", decl)[0])
    return fields


def test_struct_fields_match_the_header():
    for struct in ("zoe_tensor_desc", "zoe_buffer_view") + SIZED_STRUCTS:
        declared = [field[0] for field in getattr(_capi, struct)._fields_]
        assert declared == header_struct_fields(struct), struct


def test_sized_structs_start_with_struct_size_and_have_an_init_macro():
    """zoe.h convention 8: every option or output struct starts with size_t struct_size, has a
    ZOE_<NAME>_INIT macro that sets it, and its ctypes mirror fills it on construction."""
    text = open(HEADER, encoding="utf-8").read()
    for struct in SIZED_STRUCTS:
        assert header_struct_fields(struct)[0] == "struct_size", struct
        macro = "ZOE_%s_INIT" % struct[len("zoe_"):].upper()
        definition = re.search(r"#define %s\b(.*?)\}" % macro, text, flags=re.S)
        assert definition, macro
        assert ".struct_size = sizeof(%s)" % struct in definition.group(1), macro
        mirror = getattr(_capi, struct)
        assert issubclass(mirror, _capi.SizedStructure), struct
        assert mirror._fields_[0] == ("struct_size", _capi.c_size_t), struct
        assert mirror().struct_size == _capi.ctypes.sizeof(mirror), struct
    # zoe_buffer_view is an array element and carries no size (zoe.h says why).
    assert "struct_size" not in header_struct_fields("zoe_buffer_view")
    # Positional arguments fill the members after struct_size.
    hyper = _capi.zoe_hyper_params(0.1, 0.2, 0.3, 0.4, 0.5)
    assert (hyper.struct_size, hyper.lr, hyper.weight_decay) == (48, 0.1, 0.5)


def test_the_library_checks_struct_size():
    """The library refuses struct_size 0 naming the struct, and takes the mirror's own size."""
    bad = _capi.zoe_step_result()
    bad.struct_size = 0
    status = _capi.zoe_optim_step(None, 0, None, None, 0, None, 0, 1.0, _capi.ctypes.byref(bad))
    assert status == _capi.Status.INVALID_ARGUMENT
    assert b"zoe_step_result.struct_size = 0" in _capi.zoe_last_error()
    good = _capi.zoe_step_result()
    status = _capi.zoe_optim_step(None, 0, None, None, 0, None, 0, 1.0, _capi.ctypes.byref(good))
    assert status == _capi.Status.INVALID_ARGUMENT
    assert _capi.zoe_last_error() == b"invalid argument: engine is NULL"
    # zoe_nccl_collectives_create needs the whole struct: the mirror's size is C's.
    collectives = _capi.zoe_collectives()
    status = _capi.zoe_nccl_collectives_create(None, None, _capi.ctypes.byref(collectives))
    assert b"struct_size" not in _capi.zoe_last_error(), _capi.zoe_last_error()
    assert status in (_capi.Status.NOT_SUPPORTED, _capi.Status.INVALID_ARGUMENT)
    assert not collectives.context


def test_enum_values_match_the_header():
    text = open(HEADER, encoding="utf-8").read()
    pairs = dict(re.findall(r"\b(ZOE_(?:ERR|OK|TIER|ACCESS|DTYPE|STATE)\w*)\s*=\s*(\d+)", text))
    mirrors = {"ZOE_TIER_": _capi.Tier, "ZOE_ACCESS_": _capi.Access, "ZOE_DTYPE_": _capi.DType,
               "ZOE_STATE_": _capi.StateSlot, "ZOE_ERR_": _capi.Status}
    checked = 0
    for name, value in pairs.items():
        for prefix, enum in mirrors.items():
            if name.startswith(prefix):
                member = name[len(prefix):]
                member = {"IO": "IO"}.get(member, member)
                assert enum[member] == int(value), name
                checked += 1
    assert _capi.Status.OK == int(pairs["ZOE_OK"])
    assert checked == len(pairs) - 1


def test_library_loads_and_reports_its_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", _capi.zoe_version().decode())
    assert _capi.zoe_status_string(_capi.Status.NO_SPACE).decode() != "unknown status"


def test_invalid_id_constants_match_the_header():
    text = open(HEADER, encoding="utf-8").read()
    for name, value in (("TENSOR", _capi.TENSOR_ID_INVALID), ("GROUP", _capi.GROUP_ID_INVALID)):
        definition = re.search(r"#define ZOE_%s_ID_INVALID \(\(\w+\)(\w+)\)" % name, text)
        assert definition and definition.group(1) == "UINT32_MAX" and value == 2**32 - 1


def header_init_values(macro):
    """{member: float} of the designated initializers in zoe.h's ``#define macro``."""
    text = open(HEADER, encoding="utf-8").read()
    definition = re.search(r"#define %s\b(.*?)\}" % macro, text, flags=re.S).group(1)
    return {
        name: float(value)
        for name, value in re.findall(r"\.(\w+)\s*=\s*([-+0-9.eE]+)", definition)
        if name != "struct_size"
    }


def test_hyper_params_mirror_the_header():
    """Python's hyper-parameters are the header's: zoe_hyper_params' members, the INIT macro's
    defaults, and zoe.HyperParams made from both."""
    import dataclasses

    import zoe

    header = header_init_values("ZOE_HYPER_PARAMS_INIT")
    assert _capi.zoe_hyper_params.DEFAULTS == header
    members = [field.name for field in dataclasses.fields(zoe.HyperParams)]
    assert members == header_struct_fields("zoe_hyper_params")[1:]
    given = zoe.HyperParams(lr=0.5)
    for name, default in header.items():
        if name != "lr":
            assert getattr(given, name) == default, name
