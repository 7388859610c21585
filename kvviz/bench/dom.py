"""Streamlit's DOM, as the bench and the browser tests find things in a served page: one selector per thing, here only.

Streamlit names its elements with ``data-testid`` attributes (what its own browser tests read); they change between
Streamlit versions, so a rename is fixed here once for the bench (:mod:`kvviz.bench.browser`, the ``app`` section),
the browser tests and the container check (scripts/container_check.py) alike; tests/test_bench.py fails where a
selector is written anywhere else.
"""

from __future__ import annotations


def testid(name: str) -> str:
    """The CSS selector of Streamlit's element ``name`` (its ``data-testid``)."""
    return f'[data-testid="{name}"]'


APP = testid("stApp")  # the page's root; its data-test-script-state says whether a script run is under way
# The page's root before its first script run, while one is under way, or while a rerun waits for it.
RUNNING = (f'{APP}:is([data-test-script-state="initial"], [data-test-script-state="running"], '
           '[data-test-script-state="rerunRequested"])')
FILE_INPUT = f'{testid("stFileUploader")} input[type="file"]'  # a file uploader's input (set_input_files)
PRIMARY_BUTTON = testid("stBaseButton-primary")  # a run button (type="primary")
EXCEPTION = testid("stException")  # a traceback box: the page raised
ERROR = testid("stAlertContentError")  # st.error's text
RADIO = testid("stRadio")
SELECTBOX = testid("stSelectbox")
BUTTON_GROUP = testid("stButtonGroup")  # st.segmented_control / st.pills
PROGRESS = testid("stProgress")
STATUS_WIDGET = testid("stStatusWidget")  # the header's running indicator (hidden in kvviz's config)
HTML = testid("stHtml")  # st.html's output
SIDEBAR_NAV_LINK = testid("stSidebarNavLink")  # one page in the navigation menu
PLOT = ".js-plotly-plot"  # a Plotly chart (plotly.js marks its root with this class, not a testid)
