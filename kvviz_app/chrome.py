"""Page chrome every page shares: browser tab and title, the sidebar's model picker, device status."""

from __future__ import annotations

import streamlit as st

from kvviz.runtime.faults import describe_error
from kvviz.runtime.models import LoadedModel, ModelError, is_hub_id, load_model
from kvviz.runtime.settings import Settings


def settings() -> Settings:
    """Deployment limits from the environment (upload size, prompt and generation caps)."""
    return Settings.from_env()


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
