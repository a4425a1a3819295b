"""Device correctness without a GPU: every consumer computes where the layer runs and moves only small results.

The detector: :class:`DeviceSimulation`, a ``TorchFunctionMode`` under which :class:`Simulated` tensors stand for
tensors on other devices — two of them, ``cuda:1`` and ``cuda:2`` (:class:`OnGpu1`, :class:`OnGpu2`), one per
layer as an accelerate device map places them. They are CPU tensors underneath, so every number is computed
exactly as on the CPU, but inside the simulation

* ``.device`` of a simulated tensor reads its device, and factories called with ``device=`` one of them
  (``torch.zeros(..., device=x.device)``), ``.to(x.device)``, ``new_zeros``/``zeros_like`` of one, and every op on
  simulated tensors give tensors on that device;
* an op whose tensor arguments are on different devices raises ``RuntimeError("device mismatch ...")`` — what
  CUDA raises ("Expected all tensors to be on the same device"), and stricter for index tensors and slice
  assignment, which must be made on (or moved to) the right device explicitly. Plain (CPU) 0-dim tensors mix
  freely, as CPU scalars do with CUDA tensors;
* ``.cpu()`` / ``.to("cpu")`` of a simulated tensor return a plain copy and are recorded with their shapes, as
  are ``.tolist()`` calls, so a test can see which maps crossed to the CPU; ``.numpy()`` raises.

Each consumer the tools use is run twice on one capture: plainly, and through :class:`Tee`, with every tensor of
the ``LayerAttention`` it receives (and the model-derived tensors it was built with: Grams, projections) on the
layer's simulated device. The two must give exactly the same results.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from families import build_family
from reference import collapse_statistics
from torch import Tensor
from torch.overrides import TorchFunctionMode

from agent_tools.analysis.collapse import centred_logit_norm
from agent_tools.analysis.heads import HEAD_ROLES, SequenceLayout
from agent_tools.analysis.metrics import attention_entropy, masked_softmax, sink_key_mask
from agent_tools.analysis.scaling import row_measures
from agent_tools.capture import LayerAttention, capture_attention
from agent_tools.consumers import host
from agent_tools.consumers.collapse import CollapseConsumer, output_grams_for
from agent_tools.consumers.grid import QuantisedMaps
from agent_tools.consumers.head_inputs import HeadInputsConsumer
from agent_tools.consumers.head_map import HeadMapConsumer
from agent_tools.consumers.last_row import LastRowConsumer
from agent_tools.consumers.received import ReceivedShareConsumer
from agent_tools.consumers.roles import RoleScoreConsumer, role_scores
from agent_tools.consumers.rollout import RolloutConsumer
from agent_tools.consumers.scaling import ScalingConsumer
from agent_tools.consumers.segment_shares import SegmentAccumulator
from agent_tools.consumers.target_row import TargetRowConsumer
from agent_tools.families import read_facts

CPU = torch.device("cpu")
LENGTH = 7  # tokens: differs from the 4 heads and the chunk of 3 rows, so a map's (q, Tk) is recognisable
CHUNK = 3


class Simulated(torch.Tensor):
    """A tensor that, inside :class:`DeviceSimulation`, lives on ``simulated_device`` (its data is on the CPU)."""

    simulated_device: ClassVar[torch.device]
    __torch_function__ = torch._C._disabled_torch_function_impl  # the simulation (a mode) decides everything


class OnGpu1(Simulated):
    simulated_device = torch.device("cuda", 1)


class OnGpu2(Simulated):
    simulated_device = torch.device("cuda", 2)


SIMULATED: dict[torch.device, type[Simulated]] = {cls.simulated_device: cls for cls in (OnGpu1, OnGpu2)}


def layer_device(layer: int) -> type[Simulated]:
    """Where layer ``layer`` runs: a two-GPU device map, even layers on cuda:1, odd ones on cuda:2."""
    return OnGpu1 if layer % 2 == 0 else OnGpu2


def device_of(tensor: Tensor) -> torch.device:
    return tensor.simulated_device if isinstance(tensor, Simulated) else CPU


def to_device(value: Any, cls: type[Simulated] = OnGpu1) -> Any:
    """Tensors (in tuples, lists, dicts) as views on the simulated device ``cls``."""
    if isinstance(value, Tensor):
        return value if type(value) is cls else value.as_subclass(cls)
    if isinstance(value, tuple) and hasattr(value, "n_fields"):  # torch.return_types (max, min, ...)
        return type(value)([to_device(v, cls) for v in value])
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, cls) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, cls) for k, v in value.items()}
    return value


def to_plain(value: Any) -> Any:
    """Plain tensors (dataclasses as dicts of their fields), for comparing results outside the simulation."""
    if isinstance(value, Tensor):
        return value.as_subclass(Tensor)
    if isinstance(value, tuple) and hasattr(value, "n_fields"):
        return type(value)([to_plain(v) for v in value])
    if isinstance(value, (tuple, list)):
        return type(value)(to_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, slice):
        yield from _tensors((value.start, value.stop, value.step))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield from _tensors([getattr(value, f.name) for f in dataclasses.fields(value)])


def _simulated(device: Any) -> type[Simulated] | None:
    """The class of a simulated device named by a device argument, or None."""
    if isinstance(device, (str, torch.device)):
        return SIMULATED.get(torch.device(device))
    return None


def _sanitised(value: Any) -> Any:
    """Device arguments naming a simulated device replaced by the CPU, where the data really is."""
    return CPU if _simulated(value) is not None else value


_DEVICE_GETTER = torch.Tensor.device.__get__
_SCALAR_READS = {
    torch.Tensor.item,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
    torch.Tensor.__len__,
}
_MOVES = {torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.cuda}


class DeviceSimulation(TorchFunctionMode):
    """The mode that makes :class:`Simulated` tensors behave as if they were on their devices."""

    def __init__(self) -> None:
        super().__init__()
        self.crossings: list[tuple[str, tuple[int, ...]]] = []  # (how, shape) of each crossing to the CPU

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func == _DEVICE_GETTER:
            return device_of(args[0]) if isinstance(args[0], Simulated) else func(*args, **kwargs)
        if func in _MOVES:
            return self._move(func, args, kwargs)
        if func is torch.Tensor.numpy and isinstance(args[0], Simulated):
            raise RuntimeError("device mismatch: numpy() of a tensor on a GPU")
        if func is torch.Tensor.tolist and isinstance(args[0], Simulated):
            self.crossings.append(("tolist", tuple(args[0].shape)))
            return func(*args, **kwargs)
        if func in _SCALAR_READS:
            return func(*args, **kwargs)
        factory = _simulated(kwargs.get("device"))
        if factory is not None:
            kwargs["device"] = CPU
        tensors = list(_tensors((args, kwargs)))
        devices = {device_of(t) for t in tensors if isinstance(t, Simulated) or t.dim() > 0}
        if factory is not None:
            devices.add(factory.simulated_device)
        if len(devices) > 1:
            name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            shapes = [(str(device_of(t)), tuple(t.shape)) for t in tensors]
            raise RuntimeError(f"device mismatch in {name}: {shapes}")
        result = func(*args, **kwargs)
        on = next((SIMULATED[d] for d in devices if d in SIMULATED), None)
        return to_device(result, on) if on is not None else result

    def _move(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``.cpu()``, ``.cuda()``, ``.to(...)``: where the result lives follows the target device."""
        source = args[0]
        target: torch.device | None = CPU if func is torch.Tensor.cpu else None
        for value in (*args[1:], kwargs.get("device")):
            if isinstance(value, (str, torch.device)):
                target = torch.device(value)
            elif isinstance(value, Tensor):  # .to(other): other's dtype and device
                target = device_of(value)
        if func is torch.Tensor.cuda:
            target = torch.device("cuda", 1) if not args[1:] else torch.device("cuda", args[1])
            result = source
        else:
            clean_args = tuple(_sanitised(a) for a in args)
            clean_kwargs = {k: _sanitised(v) for k, v in kwargs.items()}
            result = func(*clean_args, **clean_kwargs)
        here = device_of(source)
        if target is None:  # dtype only: stays where it is
            target = here
        if target != here:
            result = result.as_subclass(Tensor).clone()  # a copy to another device
            if here != CPU and target == CPU:
                self.crossings.append(("cpu", tuple(source.shape)))
        cls = _simulated(target)
        return to_device(result, cls) if cls is not None else result.as_subclass(Tensor)


class Tee:
    """Feeds ``plain`` each captured layer as it is and ``moved`` the same layer on the simulated device."""

    def __init__(self, plain: Any, moved: Any, simulation: DeviceSimulation) -> None:
        self.plain, self.moved, self.simulation = plain, moved, simulation
        self.accepts_key_prefix = plain.accepts_key_prefix
        self.shapes: set[tuple[int, int]] = set()  # (q, key width) of every chunk: what a map crossing looks like
        self.error: Exception | None = None  # the first failure of the moved consumer (it is not fed again)

    def on_layer(self, layer: LayerAttention) -> None:
        self.shapes.add((layer.weights.shape[2], layer.key_width))
        self.shapes.add((layer.query_length, layer.key_length))
        if self.error is None:
            try:
                with self.simulation:
                    self.moved.on_layer(moved_layer(layer))
            except RuntimeError as exc:  # reported per consumer by the test, without stopping the others
                self.error = exc
        self.plain.on_layer(layer)


def moved_layer(layer: LayerAttention) -> LayerAttention:
    """The same layer with every tensor (and the cached row measures) on the layer's simulated device."""
    cls = layer_device(layer.layer)
    names = ("query", "key", "value", "mask", "weights", "logits", "output", "layer_input", "position_embeddings")
    moved = {name: to_device(getattr(layer, name), cls) for name in names}
    return dataclasses.replace(layer, **moved, _cache=to_device(dict(layer._cache), cls))


# --- the consumers every tool uses, built twice (plain, and with model tensors on the simulated device) -------


@dataclass
class Case:
    """One consumer: how to build it (``on_device`` moves the model-derived tensors it holds) and read it."""

    name: str
    build: Callable[[bool], Any]
    read: Callable[[Any, bool], Any]  # (consumer, on_device) -> its results
    keeps_maps: bool = False  # its job is to keep maps: it may move them to the CPU
    results_on_device: bool = False  # its results are maps it keeps where the layer ran (rollout, head inputs)


def _layout(causal: bool) -> SequenceLayout:
    tokens = ["<bos>", "the", "cat", ",", "sat", "[SEP]", "."]
    special = [True, False, False, False, False, True, False]
    return SequenceLayout.for_text(tokens, special, causal=causal)


def _cases(model: torch.nn.Module) -> list[Case]:
    facts = read_facts(model)
    heads = facts.num_heads
    sinks = sink_key_mask([True, False, False, False, False, True, False])
    grams = output_grams_for(model, list(range(facts.num_layers)), heads)

    def collapse(on_device: bool, subset: list[int] | None) -> CollapseConsumer:
        placed = {layer: to_device(g, layer_device(layer)) for layer, g in grams.items()}  # read from each layer
        return CollapseConsumer(sinks, heads=subset, output_grams=placed if on_device else grams)

    def head_inputs(on_device: bool) -> HeadInputsConsumer:
        consumer = HeadInputsConsumer.for_heads(model, facts, 1, [2, 0])
        if on_device:  # the projections are read from the model's weights: on the layer's device
            p = consumer.projections
            moved = {f.name: to_device(getattr(p, f.name), layer_device(1)) for f in dataclasses.fields(p)}
            consumer.projections = dataclasses.replace(p, **moved)
        return consumer

    def segments(rows: Tensor) -> Any:
        index = torch.tensor([0, 0, 1, 1, 2, 2, 1])  # prompt tokens -> segments (a CPU tensor, as prompts give)
        accumulator = SegmentAccumulator(index, 4, sink=0, generated=3)
        accumulator.add(rows)
        accumulator.add(torch.cat([rows, rows[..., :1]], -1) / 2)  # a generated step: one more key
        return (accumulator.mean_head_shares(), accumulator.mean_token_weights(), accumulator.step_top_keys)

    scaling_args = {"model_scale": facts.scaling, "query_prescaled": facts.query_prescaled}
    layout = _layout(facts.is_causal)
    return [
        Case(
            "grid",
            lambda _d: QuantisedMaps(facts.num_layers, heads, LENGTH),
            lambda c, _d: (c.maps, c.entropy, c.normalised_entropy, c.first_token_share, c.max_weight),
            keeps_maps=True,
        ),
        Case(
            "grid_stats",
            lambda _d: QuantisedMaps(facts.num_layers, heads, LENGTH, keep_maps=False),
            lambda c, _d: (c.entropy, c.normalised_entropy, c.first_token_share, c.max_weight),
        ),
        Case("collapse", lambda d: collapse(d, None), lambda c, _d: c.results()),
        Case("collapse_heads", lambda d: collapse(d, [3, 1]), lambda c, _d: c.results()),
        Case("scaling", lambda _d: ScalingConsumer(1, range(heads), [0.5, 2.0], **scaling_args), _scaling),
        Case("scaling_head", lambda _d: ScalingConsumer(0, [2], [4.0], **scaling_args), _scaling),
        Case("roles", lambda _d: RoleScoreConsumer(layout, HEAD_ROLES, heads), lambda c, _d: c.scores()),
        Case("rollout", lambda _d: RolloutConsumer(), lambda c, _d: c.rollout(), results_on_device=True),
        Case("received", lambda _d: ReceivedShareConsumer(), lambda c, _d: c.received()),
        Case("last_row", lambda _d: LastRowConsumer(), lambda c, _d: c.take()),
        Case(
            "segment_shares",
            lambda _d: LastRowConsumer(),
            lambda c, d: segments(to_device(c.take()) if d else c.take()),
        ),
        Case("head_inputs", head_inputs, lambda c, _d: c.inputs(), keeps_maps=True, results_on_device=True),
        Case("head_map", lambda _d: HeadMapConsumer(1, 2), lambda c, _d: c.result(), keeps_maps=True),
        Case("target_row", lambda _d: TargetRowConsumer(1, 5), lambda c, _d: c.row),
    ]


def _scaling(consumer: ScalingConsumer, _on_device: bool) -> Any:
    settings = [(s.kind, s.rows, s.sums, s.derivative) for s in consumer.settings]
    return consumer.variances(), settings, consumer.monotone_rows, consumer.monotone_violations


def _flatten(value: Any) -> Iterator[Any]:
    value = to_plain(value)
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _flatten(item)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield key
            yield from _flatten(value[key])
    else:
        yield value


def assert_identical(a: Any, b: Any) -> None:
    left, right = list(_flatten(a)), list(_flatten(b))
    assert len(left) == len(right)
    for x, y in zip(left, right, strict=True):
        if isinstance(x, Tensor):
            assert isinstance(y, Tensor) and x.dtype == y.dtype and x.shape == y.shape
            if x.is_floating_point():  # NaN where the other has NaN, every other entry equal
                assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())
            else:
                assert torch.equal(x, y)
        elif isinstance(x, float) and math.isnan(x):
            assert isinstance(y, float) and math.isnan(y)
        else:
            assert x == y


def _any_on_device(value: Any) -> bool:
    return any(isinstance(t, Simulated) for t in _tensors(value))


@pytest.fixture(autouse=True)
def _float64_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation checks where consumers compute, exactly: sums on a simulated accelerator in float64, as on
    the CPU (float32 sums on an accelerator are checked in test_host_syncs)."""
    monkeypatch.setattr(host, "ACCELERATOR_SUMS", torch.float64)


def _run(family: str, *, query_chunk: int | None) -> list[tuple[Case, Any, Any, DeviceSimulation, Tee]]:
    model = build_family(family)
    cases = _cases(model)
    simulations = [DeviceSimulation() for _ in cases]
    tees = [Tee(case.build(False), case.build(True), sim) for case, sim in zip(cases, simulations, strict=True)]
    ids = torch.tensor([[0, 7, 9, 30, 11, 5, 31]])
    assert ids.shape[1] == LENGTH
    with torch.inference_mode(), capture_attention(model, tees, query_chunk=query_chunk, record_inputs=True):
        model(input_ids=ids)
    found = []
    for case, sim, tee in zip(cases, simulations, tees, strict=True):
        with torch.inference_mode():
            plain = case.read(tee.plain, False)
            try:
                if tee.error is not None:
                    raise tee.error
                with sim:
                    moved = case.read(tee.moved, True)
            except RuntimeError as exc:
                moved = exc
        found.append((case, plain, moved, sim, tee))
    return found


@pytest.mark.parametrize("family", ["llama", "bert"])
@pytest.mark.parametrize("query_chunk", [None, CHUNK])
def test_consumers_compute_on_the_layer_device(family: str, query_chunk: int | None) -> None:
    failures = []
    for case, plain, moved, sim, tee in _run(family, query_chunk=query_chunk):
        if isinstance(moved, Exception):  # (a) a device mismatch (or a numpy() of a device tensor)
            failures.append(f"{case.name}: {moved}")
            continue
        try:
            assert_identical(plain, moved)  # (b) the same numbers, exactly
        except AssertionError:
            failures.append(f"{case.name}: results differ on the simulated device")
        # small results end on the CPU; only the maps a consumer keeps by design stay on the device
        if _any_on_device(moved) != case.results_on_device:
            where = "the device" if case.results_on_device else "the CPU"
            failures.append(f"{case.name}: results should be on {where}")
        # (c) no map crossed to the CPU unless keeping maps is the consumer's job
        maps = [(how, shape) for how, shape in sim.crossings if len(shape) >= 2 and shape[-2:] in tee.shapes]
        maps = [(how, shape) for how, shape in maps if shape[-1] > 1 and shape[-2] > 1]
        if maps and not case.keeps_maps:
            failures.append(f"{case.name}: maps crossed to the CPU: {maps}")
    assert not failures, "\n".join(failures)


def test_whole_map_entry_points_follow_their_input() -> None:
    """collapse_statistics and role_scores build their index tensors where the maps are."""
    torch.manual_seed(0)
    length = 6
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    weights = torch.softmax(torch.randn(2, length, length).masked_fill(~allowed, -1e9), -1)
    sinks = sink_key_mask([True] + [False] * (length - 1))
    layout = SequenceLayout.for_text(["a", ",", "b", "c", ".", "d"], [False] * length, causal=True)
    plain = (collapse_statistics(weights, weights.log(), allowed, sinks), role_scores(weights, layout))
    with DeviceSimulation():
        moved = (
            collapse_statistics(to_device(weights), to_device(weights.log()), to_device(allowed), sinks),
            role_scores(to_device(weights), layout),
        )
    assert_identical(plain, moved)


def test_detector_catches_a_mismatch() -> None:
    """The simulation itself: mixing devices raises, crossings are recorded, factories follow ``device=``."""
    simulation = DeviceSimulation()
    with simulation:
        x = to_device(torch.ones(3, 2), OnGpu1)
        assert x.device == torch.device("cuda", 1)
        with pytest.raises(RuntimeError, match="device mismatch"):
            torch.zeros(3, 2) + x
        with pytest.raises(RuntimeError, match="device mismatch"):
            x.index_select(0, torch.tensor([0, 2]))
        with pytest.raises(RuntimeError, match="device mismatch"):
            x + to_device(torch.ones(3, 2), OnGpu2)  # two GPUs of a device map
        with pytest.raises(RuntimeError, match="device mismatch"):
            torch.zeros(3, 2)[:, 0] = x[:, 0]
        y = torch.zeros(3, 2, device=x.device) + x + torch.tensor(1.0)  # 0-dim CPU scalars mix, as with CUDA
        assert isinstance(y, OnGpu1) and isinstance(x.sum(0), OnGpu1) and isinstance(x.new_zeros(2), OnGpu1)
        assert type(y.sum(0).cpu()) is Tensor and isinstance(torch.ones(2).to(x.device), OnGpu1)
        assert isinstance(y.to(torch.device("cuda", 2)), OnGpu2) and isinstance(y.double(), OnGpu1)
    assert simulation.crossings == [("cpu", (2,))]


# --- precision ---------------------------------------------------------------------------------------------


def _statistics(model: torch.nn.Module) -> dict[str, Tensor]:
    facts = read_facts(model)
    sinks = sink_key_mask([True, False, False, False, False, True, False])
    grid = QuantisedMaps(facts.num_layers, facts.num_heads, LENGTH)
    collapse = CollapseConsumer(sinks, output_grams=output_grams_for(model, [0, 1], facts.num_heads))
    roles = RoleScoreConsumer(_layout(facts.is_causal), HEAD_ROLES, facts.num_heads)
    scaling = ScalingConsumer(1, range(facts.num_heads), [2.0], model_scale=facts.scaling)
    ids = torch.tensor([[0, 7, 9, 30, 11, 5, 31]])
    with torch.inference_mode(), capture_attention(model, [grid, collapse, roles, scaling], query_chunk=CHUNK):
        model(input_ids=ids)
    found = collapse.results()
    model_setting = next(s for s in scaling.settings if s.kind == "model_scale").means()
    return {
        "grid_entropy": grid.entropy,
        "grid_normalised": grid.normalised_entropy,
        "collapse_entropy": torch.tensor([h.mean_entropy for h in found]),
        "collapse_radius": torch.tensor([h.mean_centred_score_norm for h in found]),
        "broad": roles.scores()[1]["broad"],
        "scaling_entropy": torch.tensor([model_setting["entropy"], model_setting["jacobian_frobenius"]]),
        "scaling_variance": scaling.variances()["scaled_variance"],
    }


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_bfloat16_statistics_are_upcast(family: str) -> None:
    """A bfloat16 model's statistics are finite, float32 or wider, and match the float32 model's to bf16 size."""
    reference = _statistics(build_family(family))
    half = _statistics(build_family(family).to(torch.bfloat16))
    for name, value in half.items():
        assert value.dtype in (torch.float32, torch.float64), name
        assert bool(torch.isfinite(value).all()), name
        scale = reference[name].abs().clamp_min(1.0)
        error = float(((value.double() - reference[name].double()).abs() / scale).max())
        assert error < 0.01, f"{name}: relative error {error:.3g} against float32"  # 2.5 bf16 epsilons (2⁻⁸)


def test_half_precision_reductions_are_upcast() -> None:
    """Entropy, centred norms and the row measures of bfloat16 inputs are computed in float32."""
    torch.manual_seed(0)
    logits = (4 * torch.randn(3, 5, 6)).bfloat16()
    allowed = torch.ones(5, 6, dtype=torch.bool).tril(1)
    weights = masked_softmax(logits.float(), allowed).bfloat16()
    wide_logits, wide_weights = logits.float(), weights.float()
    for half, wide in [
        (attention_entropy(weights), attention_entropy(wide_weights)),
        (centred_logit_norm(logits, allowed), centred_logit_norm(wide_logits, allowed)),
        *zip(
            dataclasses.astuple(row_measures(weights, allowed)),
            dataclasses.astuple(row_measures(wide_weights, allowed)),
            strict=True,
        ),
    ]:
        assert half.dtype == wide.dtype and torch.equal(half, wide)
