"""Shared Streamlit helpers for the pages (views/): cached model loading, the model picker, device status.

Streamlit lives here and in the pages only; the engine (kvviz/) never imports it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TypeVar

import streamlit as st

from kvviz import plots
from kvviz.capture import AttentionStats
from kvviz.config import Settings
from kvviz.faults import describe_error
from kvviz.memory import model_card
from kvviz.methods import REGISTRY, Budget, Param, SpecError, parse_spec
from kvviz.models import LoadedModel, ModelError, is_hub_id, load_model
from kvviz.needle import NeedleReport
from kvviz.prompts import LengthCheck, decode_upload, prompt_limit, truncate_middle
from kvviz.results import Comparison, MethodResult
from kvviz.runqueue import DONE, RunQueue, Ticket
from kvviz.runs import (
    AttentionRequest,
    CompareRequest,
    NeedleRequest,
    ResultStore,
    RunRequest,
    TailRequest,
)
from kvviz.session import PromptError, encode_prompt
from kvviz.tail import TailReport

T = TypeVar("T")


@st.cache_resource(show_spinner=False, max_entries=4)
def cached_model(name: str, weights: str = "auto") -> LoadedModel:
    """One shared instance per model for every user of this server."""
    return load_model(name, device=settings().device, weights=weights)


def page_header(tab: str | None, title: str, caption: str) -> None:
    """Every page's browser tab ("kvviz · <tab>"), title and short explanation, set the same way."""
    st.set_page_config(page_title=f"kvviz · {tab}" if tab else "kvviz", page_icon="🗜️", layout="wide")
    st.title(title)
    st.caption(caption)


def require_model() -> LoadedModel:
    """The sidebar's model; the page stops here (the sidebar says why) until one is loaded."""
    loaded = model_picker()
    if loaded is None:
        st.stop()
    return loaded


def model_picker() -> LoadedModel | None:
    """Sidebar picker shared by every page; returns the loaded model or shows why it failed.

    In class mode (KVVIZ_ALLOWED_MODELS) users pick from the list only. Otherwise they may also type a hub id; what
    they type is never used as a local path (folders come from the server's KVVIZ_* settings only).
    """
    config = settings()
    options = config.models_offered
    chosen = st.query_params.get("model", options[0])
    with st.sidebar:
        st.subheader("Model")
        if config.class_mode:
            if chosen not in options:
                st.warning(f"'{chosen}' is not offered on this server; choose one of the listed models.")
                chosen = options[0]
            name = st.selectbox("Model", options, index=options.index(chosen), key="model_name")
        else:
            extra = [] if chosen in options or not is_hub_id(chosen) else [chosen]
            chosen = chosen if chosen in options + extra else options[0]
            name = st.selectbox("Model", options + extra + ["other…"], index=(options + extra).index(chosen),
                                key="model_name", help="The embedded default runs everywhere; others need the hub.")
            if name == "other…":
                name = st.text_input("Hugging Face hub id", key="model_custom",
                                     placeholder="Qwen/Qwen2.5-0.5B-Instruct").strip()
                if not name:
                    return None
                if not is_hub_id(name):
                    st.error(f"'{name}' is not a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'.")
                    return None
    if name != st.query_params.get("model", options[0]):
        st.query_params["model"] = name
    try:
        with st.spinner(f"Loading {name}…"):
            return cached_model(name)
    except (ModelError, OSError, ValueError) as error:
        st.sidebar.error(f"Could not load {name}: {describe_error(error)}")
        return None


def device_status(loaded: LoadedModel) -> dict[str, str]:
    """Device facts for the status panel."""
    import torch

    status = {"device": loaded.device, "dtype": str(loaded.dtype).removeprefix("torch.")}
    if loaded.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        status["GPU"] = torch.cuda.get_device_name()
        status["GPU memory free"] = f"{free / 2**30:.1f} / {total / 2**30:.1f} GiB"
    else:
        status["CPU threads"] = str(torch.get_num_threads())
    return status


# ----------------------------------------------------------------------------------------------------------------
# Settings in the URL, prompts, method configurators and cached runs shared by the pages.


def settings() -> Settings:
    """Deployment limits from the environment (upload size, prompt and generation caps)."""
    return Settings.from_env()


def query_value(name: str, default: T, cast: Callable[[str], T] | None = None) -> T:
    """A setting from the URL's query parameters, or ``default`` when absent or unreadable."""
    raw = st.query_params.get(name)
    if raw is None:
        return default
    convert = cast or type(default)
    try:
        if convert is bool:
            return raw.lower() in ("1", "true", "yes", "on")  # type: ignore[return-value]
        return convert(raw)
    except (TypeError, ValueError):
        return default


def share_settings(**values: object) -> None:
    """Write the page's settings into the URL so that copying it shares them (lists become repeated keys)."""
    for name, value in values.items():
        text = [str(v) for v in value] if isinstance(value, (list, tuple)) else str(int(value) if isinstance(
            value, bool) else value)
        current = st.query_params.get_all(name) if isinstance(text, list) else st.query_params.get(name)
        if current != text:
            st.query_params[name] = text


def prompt_input(key: str, default: str, height: int = 160) -> str | None:
    """A prompt from a text box or an uploaded .txt/.md file (size-limited).

    A rejected upload returns None (its error shown) rather than falling back to the text box: the page then runs
    nothing until the user removes or replaces the file.
    """
    limit = settings().max_upload_mb
    text = st.text_area("Prompt", default, height=height, key=f"{key}_text")
    upload = st.file_uploader(f"…or upload a .txt / .md file (up to {limit} MB)", type=["txt", "md"],
                              key=f"{key}_file")
    if upload is not None:
        try:
            text = decode_upload(upload.name, upload.getvalue(), limit * 2**20)
            st.caption(f"Using **{upload.name}** ({len(text):,} characters) instead of the text box.")
        except PromptError as error:
            st.error(f"{error}. Nothing runs until you remove or replace the file.")
            return None
    return text


def encode(loaded: LoadedModel, text: str | None, chat: bool, max_new_tokens: int = 0) -> list[int] | None:
    """Token ids of the prompt, or None after showing why it cannot run (no prompt, empty, too long, no template).

    A prompt over the server's limit is refused unless the user asks to cut its middle (see
    :func:`kvviz.prompts.truncate_middle`); once they do, only what was cut is shown, no error.
    """
    if text is None:
        return None
    try:
        ids = encode_prompt(loaded.tokenizer, text, chat=chat)
    except PromptError as error:
        st.error(f"Cannot run this prompt: {error}.")
        return None
    check = LengthCheck(len(ids), prompt_limit(model_card(loaded).context_length, settings().max_prompt_tokens,
                                               max_new_tokens))
    if check.too_long:
        if not st.toggle(f"Cut the middle to fit {check.limit:,} tokens", key=f"truncate_{len(ids)}_{check.limit}",
                         help="Keeps the document's start and end (the question), cut before the chat template."):
            st.error(check.message)
            return None
        try:
            truncation = truncate_middle(loaded.tokenizer, text, chat, check.limit)
        except PromptError as error:
            st.error(f"Cannot run this prompt: {error}.")
            return None
        st.info(truncation.message)
        ids = truncation.token_ids
    return ids


@st.cache_data(show_spinner=False, max_entries=64)
def token_texts(model_name: str, ids: tuple[int, ...], _tokenizer, skip_special: bool = False) -> list[str]:
    """Each token decoded on its own, for text shaded token by token."""
    return [_tokenizer.decode([i], skip_special_tokens=skip_special) for i in ids]


def method_output(loaded: LoadedModel, result: MethodResult) -> bool:
    """One method's generated text with where it first departs from the full cache's marked in red; False (and the
    error shown) when the method failed."""
    st.markdown(f"**{result.method}**")
    if result.error:
        st.error(result.error)
        return False
    tokens = token_texts(loaded.name, tuple(result.token_ids), loaded.tokenizer, skip_special=True)
    st.html(plots.divergence_html(tokens, result.first_divergence))
    return True


def unrecorded(callback: Callable[..., None]) -> Callable[..., None]:
    """Run Streamlit calls made from inside a cached computation without recording them for cache replay.

    Progress bars live outside the cached function; st.cache_data would otherwise record their updates and fail
    to replay them on a cache hit. The calls run in a copy of the context with Streamlit's ``in_cached_function``
    flag unset.
    """
    from streamlit.runtime.scriptrunner_utils.script_run_context import in_cached_function

    def outside_cache(*args: object) -> None:
        in_cached_function.set(False)
        callback(*args)

    def run(*args: object) -> None:
        contextvars.copy_context().run(outside_cache, *args)

    return run


class RunFailed(Exception):
    """A queued run that did not finish: cancelled, abandoned or failed (the message says which and why)."""


@st.cache_resource(show_spinner=False)
def run_queue() -> RunQueue:
    """One queue per server: runs on the model go one at a time, round-robin across users."""
    return RunQueue(abandon_after=30.0, format_error=describe_error)


_active: dict[str, Ticket] = {}  # browser session id -> its run in the queue (for the Cancel button)


def _session_id() -> str:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    context = get_script_run_ctx()
    return context.session_id if context is not None else "local"


def through_queue(user: str, job: Callable[[Callable[[float, str], None]], T],
                  progress: Callable[[float, str], None]) -> T:
    """Run ``job`` in the shared queue while reporting the place in line, then the run's own progress.

    Polling keeps the run alive; a page that stops polling (closed tab, rerun, Cancel) gives its slot back.
    """
    queue = run_queue()
    ticket = queue.submit(user, job)
    _active[user] = ticket
    try:
        while not ticket.done.wait(0.2):
            ticket.touch()
            progress(ticket.fraction, queue_message(queue.ahead(ticket), ticket))
    finally:
        if not ticket.finished:
            ticket.cancel()  # interrupted (rerun or closed page): nobody will read this result
        if _active.get(user) is ticket:
            del _active[user]
    if ticket.status != DONE:
        raise RunFailed(ticket.error or ticket.status)
    return ticket.result


def queue_message(ahead: int, ticket: Ticket) -> str:
    """What the progress bar says: how many runs are ahead in line, or the run's own progress."""
    if ahead:
        return f"Queued behind {ahead} other run{'s' if ahead > 1 else ''}…"
    return "Starting…" if ticket.status == "queued" else ticket.message


def _cancel(user: str, request_key: str | None) -> None:
    ticket = _active.get(user)
    if ticket is not None:
        ticket.cancel()
    if request_key:
        st.session_state.pop(request_key, None)
    st.session_state["kvviz_notice"] = "Run cancelled."


def queued(compute: Callable[[str, Callable[[float, str], None]], T], start_text: str,
           request_key: str | None = None) -> T:
    """Show a progress bar and a Cancel button around a cached, queued computation; stop the page on failure.

    ``compute(user, progress)`` is a st.cache_data function that calls :func:`through_queue` on a miss.
    """
    notice = st.session_state.pop("kvviz_notice", None)
    if notice:
        st.info(notice)
    user = _session_id()
    bar = st.progress(0.0, text=start_text)
    cancel = st.empty()
    cancel.button("Cancel run", key=f"cancel_{request_key or start_text}", on_click=_cancel,
                  args=(user, request_key))
    try:
        result = compute(user, unrecorded(lambda f, m: bar.progress(min(1.0, max(0.0, f)), text=m)))
    except RunFailed as error:
        bar.empty()
        cancel.empty()
        st.error(f"The run did not finish: {error}")
        st.stop()
    bar.empty()
    cancel.empty()
    return result


@st.cache_resource(show_spinner=False)
def result_store() -> ResultStore:
    """Results on disk, shared with the class warm-up (``make warm``) and later server processes."""
    return ResultStore.default()


@st.cache_data(show_spinner=False, max_entries=64)
def cached_run(key: str, _loaded: LoadedModel, _request: RunRequest, _user: str,
               _progress: Callable[[float, str], None]) -> object:
    """A request's result: from this server's memory, else from the result store, else run through the shared
    queue and stored. ``key`` (the request with its model) is the memory cache's key."""
    store = result_store()
    found = store.load(_loaded, _request)
    if found is not None:
        return found
    # looked up again when its turn comes: another user's identical run (a lesson step) may have stored it by then
    return through_queue(_user, lambda report: store.fetch(_loaded, _request, report), _progress)


def run_request(loaded: LoadedModel, request: RunRequest, start_text: str, request_key: str | None = None) -> object:
    """A request through the store and the shared queue, with a progress bar and a Cancel button."""
    return queued(lambda user, progress: cached_run(f"{loaded.name}:{request!r}", loaded, request, user, progress),
                  start_text, request_key)


def run_comparison(loaded: LoadedModel, prompt_ids: list[int], specs: list[str], max_new_tokens: int,
                   request_key: str | None = None) -> Comparison:
    """A comparison through the shared queue with a live progress bar (instant when the same inputs ran before)."""
    return run_request(loaded, CompareRequest(tuple(prompt_ids), tuple(specs), max_new_tokens), "Starting…",
                       request_key)


def methods_of(kind: str) -> list[str]:
    """Registered method names of one kind, ``full`` first."""
    return sorted((n for n, c in REGISTRY.items() if c.kind == kind), key=lambda n: (n != "full", n))


def _param_widget(param: Param, key: str, initial: object) -> object:
    """One widget built from a method's parameter declaration."""
    label, help_text = param.name, f"{param.help} ({param.describe_range()})"
    if param.choices is not None:
        options = list(param.choices)
        return st.selectbox(label, options, index=options.index(initial) if initial in options else 0, key=key,
                            help=help_text)
    if param.type is bool:
        return st.checkbox(label, value=bool(initial), key=key, help=help_text)
    if param.type is int:
        return st.number_input(label, value=int(initial), min_value=None if param.min is None else int(param.min),
                               max_value=None if param.max is None else int(param.max), step=1, key=key,
                               help=help_text)
    if param.type is float:
        return st.number_input(label, value=float(initial), min_value=param.min, max_value=param.max, key=key,
                               help=help_text, format="%.4f")
    return st.text_input(label, value=str(initial), key=key, help=help_text)


def _initial_values(spec: str) -> dict[str, object]:
    """Method names and parameter values a SPEC from the URL starts the widgets with."""
    try:
        stack = parse_spec(spec)
    except SpecError:
        return {}
    values: dict[str, object] = {}
    for method in stack.members():
        values[method.kind] = method.name
        for param in method.params:
            value = getattr(method, param.name)
            values[f"{method.name}.{param.name}"] = str(value) if isinstance(value, Budget) else value
    return values


def method_configurator(index: int, initial_spec: str, prefix: str = "cfg") -> str | None:
    """Architecture x eviction x quantization widgets for configuration ``index``; its SPEC or None (error shown)."""
    initial = _initial_values(initial_spec)
    chosen: list[str] = []
    for kind, none_label in (("architecture", "none"), ("eviction", "full"), ("quantization", "none")):
        options = methods_of(kind) if kind == "eviction" else [none_label, *methods_of(kind)]
        start = initial.get(kind, none_label)
        name = st.selectbox(kind.capitalize(), options, index=options.index(start) if start in options else 0,
                            key=f"{prefix}{index}_{kind}", help="\n\n".join(
                                f"**{n}**: {REGISTRY[n].summary}" for n in options if n in REGISTRY))
        if name == none_label:
            continue
        values = {p.name: _param_widget(p, f"{prefix}{index}_{name}_{p.name}",
                                        initial.get(f"{name}.{p.name}", p.default))
                  for p in REGISTRY[name].params}
        params_for = getattr(REGISTRY[name], "params_for", None)  # parameters that depend on earlier choices
        try:
            while params_for is not None and (later := [p for p in params_for(values) if p.name not in values]):
                param = later[0]
                values[param.name] = _param_widget(param, f"{prefix}{index}_{name}_{param.name}",
                                                   initial.get(f"{name}.{param.name}", param.default))
        except SpecError as error:
            st.error(str(error))
            return None
        try:
            chosen.append(REGISTRY[name](**values).spec())
        except SpecError as error:
            st.error(str(error))
            return None
    typed = st.text_input("…or type a SPEC", key=f"{prefix}{index}_spec", placeholder="snapkv:budget=64+kivi:bits=2",
                          help="name[:key=value,...][+name[:key=value,...]]; overrides the widgets above")
    spec = typed.strip() or "+".join(chosen) or "full"
    try:
        return parse_spec(spec).label
    except SpecError as error:
        st.error(str(error))
        return None


def attention_stats(loaded: LoadedModel, prompt_ids: list[int], layer: int, sink_tokens: int,
                    every_layer: bool = False) -> AttentionStats:
    """Prefill statistics through the shared queue with a progress bar (instant when cached)."""
    return run_request(loaded, AttentionRequest(tuple(prompt_ids), layer, sink_tokens, every_layer),
                       "Summing attention over every layer…" if every_layer else "Running the prompt…")


def budget_spec(name: str, tokens: int, **overrides: object) -> str | None:
    """A SPEC for eviction method ``name`` keeping about ``tokens`` tokens, built from its declared parameters.

    Splits ``tokens`` evenly over its Budget parameters (H2O: heavy and recent); None when the method is not
    registered, declares no budget, or rejects the values.
    """
    method = REGISTRY.get(name)
    budgets = [p.name for p in method.params if p.type is Budget] if method is not None else []
    if not budgets:
        return None
    values = {name: max(1, tokens // len(budgets)) for name in budgets} | overrides
    try:
        return method(**values).spec()
    except SpecError:
        return None


def run_needle(loaded: LoadedModel, specs: list[str], lengths: list[int], depths: list[float], trials: int,
               mode: str, chat: bool, max_new_tokens: int) -> NeedleReport:
    """The needle grid through the shared queue with a progress bar (instant when the same inputs ran before)."""
    return run_request(loaded, NeedleRequest(tuple(specs), tuple(lengths), tuple(depths), trials, mode, chat,
                                             max_new_tokens), "Building haystacks…", "needle_request")


def run_tail_report(loaded: LoadedModel, specs: list[str], tasks: list[str], lengths: list[int],
                    depths: list[float], hops: list[int], mode: str, protect: list[str]) -> TailReport:
    """The tail tasks through the shared queue with a progress bar (instant when the same inputs ran before)."""
    return run_request(loaded, TailRequest(tuple(specs), tuple(tasks), tuple(lengths), tuple(depths), tuple(hops),
                                           mode, tuple(protect)), "Building prompts…", "tail_request")
