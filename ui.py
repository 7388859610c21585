"""Shared Streamlit helpers for app.py and pages/: cached model loading, the model picker, device status.

Streamlit lives here and in the pages only; the engine (kvviz/) never imports it.
"""

from __future__ import annotations

import os

import streamlit as st

from kvviz.models import DEFAULT_MODEL, LoadedModel, ModelError, load_model


def allowed_models() -> list[str]:
    """Models offered in the picker: KVVIZ_ALLOWED_MODELS (comma-separated) or the default plus KVVIZ_MODEL."""
    listed = [m.strip() for m in os.environ.get("KVVIZ_ALLOWED_MODELS", "").split(",") if m.strip()]
    if listed:
        return listed
    configured = os.environ.get("KVVIZ_MODEL", DEFAULT_MODEL)
    return list(dict.fromkeys([configured, DEFAULT_MODEL]))


def class_mode() -> bool:
    """In class mode users pick only from the allowed list: no free-typed hub ids or paths."""
    return bool(os.environ.get("KVVIZ_ALLOWED_MODELS", "").strip())


@st.cache_resource(show_spinner=False, max_entries=4)
def cached_model(name: str, weights: str = "auto") -> LoadedModel:
    """One shared instance per model for every user of this server."""
    return load_model(name, weights=weights)


def model_picker() -> LoadedModel | None:
    """Sidebar picker shared by every page; returns the loaded model or shows why it failed."""
    options = allowed_models()
    params = st.query_params
    chosen = params.get("model", options[0])
    if class_mode() and chosen not in options:
        chosen = options[0]
    with st.sidebar:
        st.subheader("Model")
        if class_mode():
            name = st.selectbox("Model", options, index=options.index(chosen), key="model_name")
        else:
            extra = [] if chosen in options else [chosen]
            name = st.selectbox("Model", options + extra + ["other…"], index=(options + extra).index(chosen),
                                key="model_name", help="The embedded default runs everywhere; others need the hub.")
            if name == "other…":
                name = st.text_input("Hub id or local folder", key="model_custom",
                                     placeholder="Qwen/Qwen2.5-0.5B-Instruct").strip()
                if not name:
                    return None
    if name != params.get("model", options[0]):
        st.query_params["model"] = name
    try:
        with st.spinner(f"Loading {name}…"):
            return cached_model(name)
    except (ModelError, OSError, ValueError) as error:
        st.sidebar.error(f"Could not load {name}: {error}")
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
