"""Page chrome every page shares: browser tab and title, the sidebar's model picker, device status."""

from __future__ import annotations

import streamlit as st

from kvviz.runtime.faults import describe_error
from kvviz.runtime.models import LoadedModel, ModelError, is_hub_id, load_model
from kvviz.runtime.settings import Settings
from kvviz_app.url import ICON, Read, linked, listing, read_text, shown, unknown_settings


def settings() -> Settings:
    """Deployment limits from the environment (upload size, prompt and generation caps). Reading them changes
    nothing: the server's start-up applied them (:func:`kvviz.comparison.startup.start_server`)."""
    return Settings.from_env()


@st.cache_resource(show_spinner=False, max_entries=4)
def cached_model(name: str, weights: str = "auto") -> LoadedModel:
    """One shared instance per model (and its engine) for every user of this server."""
    return load_model(name, device=settings().device, weights=weights)


def page_header(tab: str | None, title: str, caption: str, link_settings: tuple[str, ...] = ()) -> None:
    """Every page's browser tab ("kvviz · <tab>"), title and short explanation, set the same way, and a notice for
    any setting in the link that the page does not have (``link_settings`` are its own; ``model`` is every page's)."""
    st.set_page_config(page_title=f"kvviz · {tab}" if tab else "kvviz", page_icon="🗜️", layout="wide")
    st.title(title)
    st.caption(caption)
    unknown_settings(("model", *link_settings))


def require_model() -> LoadedModel:
    """The sidebar's model; the page stops here (the sidebar says why) until one is loaded."""
    loaded = model_picker()
    if loaded is None:
        st.stop()
    return loaded


def model_from_link() -> Read[str]:
    """The model the link names: one this server offers, or (outside class mode) any hub id; anything else (a path,
    a typo) gets the first offered model and a notice saying so. What a link names is never used as a local path."""
    config = settings()
    options = config.models_offered
    read = read_text("model", options[0])
    if read.value in options or (not config.class_mode and is_hub_id(read.value)):
        return read
    why = "is not offered on this server" if config.class_mode else (
        "is neither a model this server offers nor a hub id like 'Qwen/Qwen2.5-0.5B-Instruct'")
    return Read(options[0], f"The link's {shown('model', read.value)} {why}; using {options[0]}. "
                            f"Offered: {listing(options)}.")


def model_picker() -> LoadedModel | None:
    """Sidebar picker shared by every page; returns the loaded model or shows why it failed.

    In class mode (KVVIZ_ALLOWED_MODELS) users pick from the list only. Otherwise they may also type a hub id; what
    they type is never used as a local path (folders come from the server's KVVIZ_* settings only).
    """
    config = settings()
    options = config.models_offered
    chosen = model_from_link()
    with st.sidebar:
        st.subheader("Model")
        if config.class_mode:
            name = linked("model_name", chosen, lambda value: st.selectbox("Model", options, index=options.index(value),
                                                                           key="model_name"))
        else:
            offered = options + ([] if chosen.value in options else [chosen.value])
            name = linked("model_name", chosen, lambda value: st.selectbox(
                "Model", offered + ["other…"], index=offered.index(value), key="model_name",
                help="The embedded default runs everywhere; others need the hub."))
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


def model_link_notice() -> None:
    """For a page without the sidebar's model picker: say when the link names a model this server cannot use."""
    notice = model_from_link().notice
    if notice:
        st.warning(notice, icon=ICON)


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
