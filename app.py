"""kvviz's entrypoint (`streamlit run app.py`, nothing else needed): the server's start-up, then the navigation menu.
Every page is a script under views/ (not pages/: Streamlit would also list a pages/ folder on its own, showing a stray
"app" entry on deep links)."""

from pathlib import Path

import streamlit as st

from kvviz.comparison.startup import start_server

start_server()  # once per process: the deployment settings applied (kvviz/comparison/startup.py says what and why)
st.html(Path(__file__).parent / "assets" / "quiet_runs.css")  # before any page's work: still drawing while runs compute
st.navigation([
    st.Page("views/0_Home.py", title="Home", icon=":material/home:", default=True),
    st.Page("views/1_Attention.py", title="Attention", icon=":material/visibility:"),
    st.Page("views/2_Compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("views/3_Needle.py", title="Needle", icon=":material/search:"),
    st.Page("views/4_Memory_planner.py", title="Memory planner", icon=":material/memory:"),
    st.Page("views/5_Lessons.py", title="Lessons", icon=":material/school:"),
    st.Page("views/6_Tail_risk.py", title="Tail risk", icon=":material/warning:"),
    st.Page("views/7_Prefix_reuse.py", title="Prefix reuse", icon=":material/cached:"),
    st.Page("views/8_Trade_offs.py", title="Trade-offs", icon=":material/show_chart:"),
]).run()
