# kvviz image (CPU). The classroom GPU image is described in the deployment issue; this one runs anywhere.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 KVVIZ_CACHE=/home/kvviz/.cache/kvviz
RUN useradd --create-home kvviz
WORKDIR /app
COPY requirements.txt requirements-nodeps.txt ./
RUN pip install -r requirements.txt && pip install --no-deps -r requirements-nodeps.txt
COPY --chown=kvviz:kvviz . .
USER kvviz
RUN python -m kvviz prepare
EXPOSE 8501
HEALTHCHECK CMD python -c "import urllib.request; urllib.request.urlopen('http://localhost:8501/_stcore/health')"
CMD ["python", "-m", "streamlit", "run", "app.py", "--server.port=8501", "--server.address=0.0.0.0", "--server.headless=true"]
