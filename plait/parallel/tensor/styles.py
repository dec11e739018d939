"""The words of a tensor-parallel plan: its styles, and the checks a plan passes before any split.

A plan maps module-name patterns (shell style, `*` matches any run of characters) to styles:

| style           | module        | what happens                                                |
|-----------------|---------------|-------------------------------------------------------------|
| "column"        | nn.Linear,    | output features split; the input enters a TP region here    |
|                 | Conv1D        | (transformers' Conv1D, GPT-2's: its weight is stored        |
|                 |               | transposed)                                                 |
| "column:k"      | the same      | a fused output of k equal parts (q|k|v: "column:3"): each   |
|                 |               | rank gets its slice of every part                           |
| "column_gather" | the same      | a column layer whose output is all-gathered whole (a head   |
|                 |               | split by vocabulary that returns whole logits)              |
| "row"           | nn.Linear,    | input features split; the output leaves the region (summed) |
|                 | Conv1D        |                                                             |
| "row_split"     | the same      | a row layer fed a whole input: it keeps its own slice       |
| "vocab"         | nn.Embedding  | vocabulary rows split (VocabParallelEmbedding)              |
| "vocab"         | nn.Linear     | an output head: column-parallel, logits stay split          |
| "region"        | any           | its first input (by position or keyword) enters the region  |
|                 |               | once for the column layers inside it (q, k, v: one          |
|                 |               | all-reduce, not 3)                                          |
| "sequence"      | any           | runs on a chunk of the sequence under SP: grads summed      |
| "grad_sum"      | any           | parameters kept whole, their gradients summed over tp (a    |
|                 |               | norm over this rank's heads only: Qwen3's q_norm)           |
| "enter_tail:r"  | any           | kept whole; the last r features of its output enter the     |
|                 |               | region (every rank's heads read them: MLA's rotary key)     |
| "gathered"      | any           | kept whole, and under SP run on the whole sequence (an      |
|                 |               | attention left unsplit): gathered in, this rank's chunk out |
| "experts"       | any           | a mixture of experts' experts module whose weights the plan |
|                 |               | splits by parameter: its tensor inputs enter the region, its|
|                 |               | output (each rank's partial sum) leaves it, summed          |
| "divided"       | any, inside   | its first input divided by tp: what it gives joins every    |
|                 | "experts"     | rank's partial sum whole, so the sum counts it once         |
|                 |               | (LongCat's identity expert, for its zero experts)           |

Two styles name a parameter, not a module (a pattern such as "layers.*.experts.down_proj"):
"param_column" cuts its dimension -2 (an (out, in) weight's outputs; a 1-D parameter's only
dimension), "param_row" its last (the inputs); ":k" cuts k packed parts alike, as "column:k"
does (an experts module's (E, 2·d, h) gate|up: "param_column:2").

A column style may end in "+share" ("column+share", "column:2+share", "column_gather+share"):
column layers that read the very same tensor in one forward then enter the region once
between them (plait.parallel.tensor.entry), the traffic of a "region" mark without one.
A style that splits a weight may end in "+whole" ("vocab+whole", "column_gather+share+whole"):
under SP the layer still reads and writes the whole sequence, so it enters and leaves its
region as without SP (a transformers model's embedding and head, around blocks that alone
run on sequence slices: plait.models.hf.styles). A "region+whole" runs whole under SP: it
gathers the sequence on entering, the row layers inside it sum their outputs whole, and it
keeps this rank's chunk of its output on leaving (a module that reshapes its tokens:
plan.WholeRegion).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from plait.errors import PlaitError
from plait.parallel.tensor.layers import is_conv1d, layout_of, overrides_forward

STYLES = ("column", "column_gather", "row", "row_split", "vocab", "region", "sequence", "grad_sum", "experts",
          "gathered", "enter_tail", "param_column", "param_row", "divided")
COLUMNS = ("column", "column_gather")  # styles whose layer enters the region from a whole input
ROWS = ("row", "row_split")
SPLIT = (*COLUMNS, *ROWS, "vocab")  # styles that cut a layer's weight
PARAMS = ("param_column", "param_row")  # styles that cut one parameter, named by the pattern
FUSED = ("column", *PARAMS)  # styles that may cut k packed parts alike ("column:3")
COUNTED = (*FUSED, "enter_tail")  # styles that take a ":k" ("enter_tail:r": r features)
SHARE, WHOLE = "+share", "+whole"
KINDS = {"column": ("Linear", "Conv1D"), "column_gather": ("Linear", "Conv1D"), "row": ("Linear", "Conv1D"),
         "row_split": ("Linear", "Conv1D"), "vocab": ("Embedding", "Linear")}


def parse_style(value: str) -> tuple[str, int]:
    """A plan's value -> (style, fused parts): "column" -> ("column", 1), "column:3" -> ("column", 3).

    Only a column layer may be fused: its output is k equal parts (q|k|v) that each split by t.
    A trailing "+share" (column styles only) is read by `shares_entry`, a trailing "+whole"
    (styles that split a weight) by `whole_sequence`, not here.
    """
    text = str(value)
    whole = text.removesuffix(WHOLE)
    base = whole.removesuffix(SHARE)
    style, _, parts = base.partition(":")
    if style not in STYLES:
        raise PlaitError(f"tensor-parallel plan: unknown style {value!r}",
                         hint=f"styles are {', '.join(STYLES)}; a fused column layer is \"column:k\"")
    if base != whole and style not in COLUMNS:
        raise PlaitError(f"tensor-parallel plan: {value!r} is not a style",
                         hint=f'only a column layer ({", ".join(COLUMNS)}) shares its entry: "column{SHARE}"')
    if whole != text and style not in (*SPLIT, "region"):
        raise PlaitError(f"tensor-parallel plan: {value!r} is not a style",
                         hint=f'only a layer whose weight is split ({", ".join(SPLIT)}) or a region reads '
                              f'the whole sequence under SP: "vocab{WHOLE}"')
    if not parts:
        return style, 1
    if style not in COUNTED or not parts.isdigit() or int(parts) < 1:
        raise PlaitError(f"tensor-parallel plan: {value!r} is not a style",
                         hint='only a column layer or a parameter is fused: "column:k", k the number of equal '
                              'parts of its output (q|k|v: "column:3")')
    return style, int(parts)


def shares_entry(value: str) -> bool:
    """Whether a column layer of this style shares its region entry with the other column
    layers that read the same input (plait.parallel.tensor.entry)."""
    return str(value).removesuffix(WHOLE).endswith(SHARE)


def whole_sequence(value: str) -> bool:
    """Whether a layer of this style reads and writes the whole sequence under SP: it enters
    and leaves its region as without SP (an all-reduce, not a reduce-scatter or all-gather)."""
    return str(value).endswith(WHOLE)


def resolve_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """{module or parameter name: style} for every module a pattern matches (every parameter,
    for the parameter styles); typos and clashes are errors."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        try:
            kind = parse_style(style)[0]
        except PlaitError as error:
            raise PlaitError(f"{error.args[0]} for {pattern!r}", hint=error.hint) from None
        names, what = (params, "parameter") if kind in PARAMS else (modules, "module")
        hits = [name for name in names if name and fnmatchcase(name, pattern)]
        if not hits:
            some = ", ".join(name for name in list(names)[1:6])
            raise PlaitError(f"tensor-parallel plan: {pattern!r} matches no {what}",
                             hint=f"{what} names look like: {some}")
        for name in hits:
            if styles.get(name, style) != style:
                raise PlaitError(f"tensor-parallel plan: {name} is both {styles[name]!r} and {style!r}",
                                 hint="make the patterns match each module once")
            styles[name] = style
            if kind not in PARAMS:
                _check_kind(name, modules[name], style)
    return styles


def param_split_dim(param: nn.Parameter, style: str) -> int:
    """The dimension a parameter style cuts: "param_column" the second to last (the last of a
    1-D parameter), "param_row" the last."""
    kind = parse_style(style)[0]
    return param.ndim - 1 if kind == "param_row" or param.ndim == 1 else param.ndim - 2


def _check_kind(name: str, module: nn.Module, style: str) -> None:
    style = parse_style(style)[0]
    fits = {"Linear": isinstance(module, nn.Linear), "Conv1D": is_conv1d(module),
            "Embedding": isinstance(module, nn.Embedding)}
    if style in KINDS and not any(fits[kind] for kind in KINDS[style]):
        raise PlaitError(f"tensor-parallel plan: {name} is a {type(module).__name__}, "
                         f"but style {style!r} needs {' or '.join(KINDS[style])}")
    if style in KINDS and style != "vocab" and fits["Linear"] and overrides_forward(module, nn.Linear):
        # plait's column and row layers replace the module: its own forward would be dropped (a
        # head split by vocabulary keeps it: tensor/layers.split_head_in_place)
        raise PlaitError(f"tensor-parallel plan: {name} is a {type(module).__name__}, whose forward does more "
                         f"than nn.Linear's, and style {style!r} would replace it",
                         hint=f"leave {name} out of the tp plan (it then stays whole on every rank)")


def _split_size(module: nn.Module, style: str) -> tuple[str, int]:
    """The size tp divides, named as the user knows it; a fused layer's is one part's."""
    if isinstance(module, nn.Embedding):
        return "num_embeddings", module.num_embeddings
    style, parts = parse_style(style)
    layout = layout_of(module)
    if style in ROWS:
        return "in_features", layout.in_features
    if parts > 1:
        return f"out_features / {parts} (one fused part)", layout.out_features // parts
    return "out_features", layout.out_features


def check_divisible(model: nn.Module, styles: dict[str, str], tp: int) -> None:
    """One error naming the first split layer whose size tp does not divide."""
    for name, style in styles.items():
        kind, parts = parse_style(style)
        if kind in PARAMS:
            _check_param_divisible(name, model.get_parameter(name), style, tp)
            continue
        module = model.get_submodule(name)
        if parts > 1 and layout_of(module).out_features % parts:
            raise PlaitError(f"{name}.out_features = {layout_of(module).out_features} is not "
                             f"{parts} equal parts", hint=f"check the plan's \"column:{parts}\"")
        if kind in SPLIT:
            what, size = _split_size(module, style)
            if size % tp:
                raise PlaitError(f"{name}.{what} = {size} is not divisible by tp={tp}",
                                 hint=f"choose tp among {divisors(size)}, or pad {name} to "
                                      f"{size + (-size % tp)}")


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_param_divisible(name: str, param: nn.Parameter, style: str, tp: int) -> None:
    parts = parse_style(style)[1]
    dim = param_split_dim(param, style)
    size = param.shape[dim]
    if size % (parts * tp):
        what = f"{name}.shape[{dim}] = {size}" + (f" ({parts} packed parts)" if parts > 1 else "")
        raise PlaitError(f"{what} is not divisible by tp={tp}" + (f" × {parts}" if parts > 1 else ""),
                         hint=f"choose tp among {divisors(size // parts)}")
