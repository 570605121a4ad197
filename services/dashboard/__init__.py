"""The Grafana dashboard (charts/specserve/dashboards/specserve.json) without Grafana: a real Prometheus server
scraping the services (`prometheus`), the dashboard's panels queried and drawn with matplotlib (`render`), and
`python -m services.dashboard`, which serves the stack under mixed traffic and draws the picture the docs show
(`picture`)."""
