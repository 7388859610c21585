"""kvviz's entrypoint (`streamlit run app.py`): the navigation menu. Every page is a script under pages/."""

import streamlit as st

st.navigation([
    st.Page("pages/0_Home.py", title="Home", icon=":material/home:", default=True),
    st.Page("pages/1_Attention.py", title="Attention", icon=":material/visibility:"),
    st.Page("pages/2_Compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("pages/3_Needle.py", title="Needle", icon=":material/search:"),
    st.Page("pages/4_Memory_planner.py", title="Memory planner", icon=":material/memory:"),
    st.Page("pages/5_Lessons.py", title="Lessons", icon=":material/school:"),
    st.Page("pages/6_Tail_risk.py", title="Tail risk", icon=":material/warning:"),
    st.Page("pages/7_Prefix_reuse.py", title="Prefix reuse", icon=":material/cached:"),
]).run()
