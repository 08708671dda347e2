"""onnxruntime sessions (the only importer of onnxruntime): providers, fallback, what actually ran.

Asking onnxruntime for CUDA where it cannot load silently gives the CPU provider
with only a log line; graphgrow reads session.get_providers()[0] and says so.

Every session is made from the model's bytes, with onnxruntime's external-data folder set to an
empty temporary folder: a tensor that names external data can resolve against neither the current
folder nor the model's. A model whose external data passed graphgrow's checks (load_onnx, or the
export that wrote it) names its folder instead (`external_folder`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from ..core.errors import InputError, RuntimeUnavailable, first_line

Provider = Literal["auto", "cpu", "cuda"]
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


@dataclass
class Session:
    session: ort.InferenceSession
    provider: str  # the provider that actually runs the first node: "cuda" or "cpu"
    note: str  # why this provider, said out loud when it is a fallback

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.session.get_inputs()]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    @property
    def input_dims(self) -> dict[str, list[int | str | None]]:
        """Each input's dimensions: a size, or the name of a dynamic dimension (`batch`, `sequence`)."""
        return {i.name: list(i.shape) for i in self.session.get_inputs()}

    def run(self, x: np.ndarray | dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run on one array (the model's one input) or on arrays by input name (every input named once)."""
        feeds = x if isinstance(x, dict) else {self.input_names[0]: x}
        if sorted(feeds) != sorted(self.input_names):
            raise InputError(
                f"the ONNX model takes the inputs {self.input_names[:16]}, got {sorted(feeds)[:16]}",
                "give the input spec the model was exported with (graphgrow inspect FILE.onnx shows it)",
            )
        types = {i.name: _NUMPY_TYPES.get(i.type) for i in self.session.get_inputs()}
        feeds = {
            k: v.astype(types[k])
            if types[k] is not None and v.dtype != types[k]
            else v  # a float64 model takes float64
            for k, v in feeds.items()
        }
        try:
            outputs: list[np.ndarray] = self.session.run(None, feeds)
            return outputs
        except (
            ort.capi.onnxruntime_pybind11_state.NotImplemented,
            ort.capi.onnxruntime_pybind11_state.InvalidArgument,
        ) as e:
            raise RuntimeUnavailable(
                f"onnxruntime ({self.provider}) cannot run this model: {first_line(e, 200)}", why_not_runnable(e)
            ) from e


_NUMPY_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


def max_ir_version() -> int:
    """The newest ONNX IR version this onnxruntime loads (from its release notes)."""
    major, minor = (int(p) for p in ort.__version__.split(".")[:2])
    if (major, minor) >= (1, 23):
        return 11
    if (major, minor) >= (1, 16):
        return 10
    return 9


def open_session(
    model: bytes | str | os.PathLike[str],
    provider: Provider = "auto",
    threads: int | None = None,
    tf32: bool = False,
    external_folder: Path | None = None,
) -> Session:
    """An InferenceSession on the provider asked for; 'auto' takes CUDA only when it really loads.

    `tf32=False` turns TF32 off in the CUDA provider (it is on by default), as the
    equivalence check needs. A model onnxruntime has no kernels for (float64 convs on the
    CPU provider) is a RuntimeUnavailable, not a crash.
    """
    state = ort.capi.onnxruntime_pybind11_state
    try:
        return _open_session(model, provider, threads, tf32, external_folder)
    except (state.NotImplemented, state.InvalidGraph, state.InvalidArgument, state.Fail) as e:
        raise RuntimeUnavailable(
            f"onnxruntime cannot load this model: {first_line(e, 200)}", why_not_runnable(e)
        ) from e


def why_not_runnable(e: BaseException) -> str:
    """The way out for a model onnxruntime refuses, by what it said: weights that do not fit the graph (a data file
    from another export), a type without kernels (float64, float16 on the CPU), or neither."""
    text = str(e).lower()
    if any(w in text for w in ("external", "initializer", "tensorproto", "deserialize", "out of bounds", "data file")):
        return (
            "the weights do not fit the graph: keep NAME.onnx.data from the same export beside NAME.onnx "
            "(moved or swapped?), or export the model again"
        )
    if any(
        w in text
        for w in (
            "double",
            "float16",
            "bfloat16",
            "tensor(float64)",
            "not implemented",
            "could not find an implementation",
        )
    ):
        return "export float32 models for onnxruntime (model.float()); the ONNX file itself is valid"
    return "onnxruntime refused a file the ONNX checker accepted: export the model again, or try --provider cpu"


def _open_session(
    model: bytes | str | os.PathLike[str],
    provider: Provider,
    threads: int | None,
    tf32: bool,
    external_folder: Path | None,
) -> Session:
    if provider not in ("auto", "cpu", "cuda"):
        raise RuntimeUnavailable(f"unknown provider '{provider}'", "use auto, cpu or cuda")
    src = model_bytes(model)
    if external_folder is None and isinstance(model, (str, os.PathLike)):
        external_folder = _external_folder(src, model)
    with _sealed_options(external_folder) as opts:
        if threads:
            opts.intra_op_num_threads = threads
        return _session_on(src, opts, provider, tf32)


def _external_folder(src: bytes, path: str | os.PathLike[str]) -> Path | None:
    """The folder a model file's external data is read from, once its entries passed graphgrow's checks
    (only PATH.data beside PATH); None for a self-contained model, or bytes onnx cannot parse (onnxruntime says why).
    Bytes without an external-data `location` key are not parsed (a large self-contained file would be, for nothing):
    a session without a folder finds no external data anyway."""
    import onnx

    from .onnx_external import checked_folder

    if b"location" not in src:
        return None
    try:
        proto = onnx.load_model_from_string(src)
    except Exception:
        return None
    return checked_folder(proto, path)


EXTERNAL_FOLDER_KEY = (
    "session.model_external_initializers_file_folder_path"  # kOrtSessionOptionsModelExternalInitializersFileFolderPath
)


def model_bytes(model: bytes | str | os.PathLike[str]) -> bytes:
    """The model as bytes: onnxruntime given a path resolves external data against the path's folder."""
    if not isinstance(model, (str, os.PathLike)):
        return bytes(model)
    if not Path(model).is_file():  # a pipe would block, a device would never end
        raise InputError(f"{str(model)[:200]!r} is not a regular file", "give the path of an .onnx file")
    return Path(model).read_bytes()


@contextlib.contextmanager
def _sealed_options(external_folder: Path | None = None) -> Iterator[ort.SessionOptions]:
    """SessionOptions whose external-data folder is `external_folder` (checked by the caller), else an empty
    temporary one for as long as sessions are made: onnxruntime reads initializers when the session is
    created, so nothing can be found (defence in depth)."""
    with tempfile.TemporaryDirectory(prefix="graphgrow-no-external-") as empty:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.add_session_config_entry(EXTERNAL_FOLDER_KEY, str(external_folder) if external_folder else empty)
        yield opts


def _session_on(src: bytes, opts: ort.SessionOptions, provider: Provider, tf32: bool) -> Session:
    if provider == "cpu":
        return Session(ort.InferenceSession(src, opts, providers=[CPU]), "cpu", "CPU provider, as asked")
    if CUDA not in ort.get_available_providers():
        why = f"this onnxruntime ({ort.__version__}) has no CUDA provider"
        if provider == "cuda":
            raise RuntimeUnavailable(why, "install onnxruntime-gpu, or use --provider cpu")
        return Session(ort.InferenceSession(src, opts, providers=[CPU]), "cpu", f"{why}: ran on CPU")
    cuda_opts = {"use_tf32": "1" if tf32 else "0", "cudnn_conv_algo_search": "EXHAUSTIVE"}
    preloaded = _preload_cuda_libraries()
    with _quiet_ort():
        sess = ort.InferenceSession(src, opts, providers=[(CUDA, cuda_opts), CPU])
    if sess.get_providers()[0] == CUDA:
        return Session(sess, "cuda", "CUDA provider" + ("" if tf32 else " (TF32 off)"))
    why = cuda_failure_reason(preloaded)
    if provider == "cuda":
        raise RuntimeUnavailable(why, "use --provider cpu or auto")
    return Session(sess, "cpu", f"{why}: fell back to CPU")


_preload: list[str | None] = []  # onnxruntime.preload_dlls' outcome, once per process


def _preload_cuda_libraries() -> str | None:
    """Load the CUDA and cuDNN libraries pip installed (nvidia-* wheels, which torch brings) before the
    CUDA provider needs them: onnxruntime-gpu does not find them on its own. None when it worked."""
    if not _preload:
        try:
            ort.preload_dlls(cuda=True, cudnn=True, msvc=False)
            _preload.append(None)
        except Exception as e:  # noqa: BLE001 - any failure is a reason to report, not to crash
            _preload.append(f"onnxruntime.preload_dlls() failed: {type(e).__name__}: {str(e)[:200]}")
    return _preload[0]


def cuda_failure_reason(preload_error: str | None) -> str:
    """Why the CUDA provider did not load, as precisely as can be told: no GPU is one reason among several."""
    import torch

    if not torch.cuda.is_available():
        return "onnxruntime's CUDA provider did not load: no CUDA device is visible here (torch sees none either)"
    if preload_error:
        return (
            f"torch sees {torch.cuda.device_count()} GPU(s) but onnxruntime's CUDA provider did not load: "
            f"its CUDA/cuDNN libraries could not be loaded ({preload_error})"
        )
    return (
        f"torch sees {torch.cuda.device_count()} GPU(s) but onnxruntime's CUDA provider did not load even after "
        "onnxruntime.preload_dlls(): the CUDA/cuDNN libraries found do not match this onnxruntime-gpu "
        f"({ort.__version__}; it needs CUDA 13 and cuDNN 9)"
    )


def cuda_bound_run(s: Session, data_ptr: int, shape: tuple[int, ...]) -> Callable[[], None]:
    """A call that runs `s` (CUDA provider) on a float32 input already in GPU memory at `data_ptr`, the
    outputs left on the GPU (IO binding: no host copies in a latency measurement)."""
    if s.provider != "cuda":
        raise RuntimeUnavailable(
            "IO binding to GPU memory needs the CUDA provider", "open the session with provider='cuda'"
        )
    binding = s.session.io_binding()
    binding.bind_input(s.input_names[0], "cuda", 0, np.float32, list(shape), data_ptr)
    for out in s.session.get_outputs():
        binding.bind_output(out.name, "cuda")

    def run() -> None:
        s.session.run_with_iobinding(binding)

    return run


@contextlib.contextmanager
def _quiet_ort() -> Iterator[None]:
    """onnxruntime logs a red error when CUDA fails to load; graphgrow reports the fallback itself."""
    ort.set_default_logger_severity(4)
    try:
        yield
    finally:
        ort.set_default_logger_severity(2)


def optimized_op_counts(model: bytes | str | os.PathLike[str]) -> dict[str, int]:
    """Op type → count in the graph onnxruntime (CPU, all graph optimisations) actually runs.

    Deterministic: it says whether two models deploy as the same kernels (fold's target for
    linear-only growth), where a latency ratio would only say so up to noise."""
    import collections

    import onnx

    with _sealed_options() as opts, tempfile.TemporaryDirectory() as d:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.optimized_model_filepath = os.path.join(d, "optimized.onnx")
        ort.InferenceSession(model_bytes(model), opts, providers=[CPU])
        graph = onnx.load(opts.optimized_model_filepath, load_external_data=False).graph
    return dict(collections.Counter(n.op_type for n in graph.node))


def all_values(
    proto: Any, x: np.ndarray | dict[str, np.ndarray], external_folder: Path | None = None
) -> dict[str, np.ndarray]:
    """Every node output of the ONNX model `proto` on input `x` (arrays by name for named inputs), on the CPU
    provider: each one is made a graph output of a copy (to find where a model first goes wrong)."""
    import copy

    model = copy.deepcopy(proto)
    outputs = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for name in node.output:
            if name and name not in outputs:
                model.graph.output.add().name = name
                outputs.add(name)
    session = open_session(model.SerializeToString(), "cpu", external_folder=external_folder)
    names = [o.name for o in session.session.get_outputs()]
    return dict(zip(names, session.run(x)))
