"""Day-2 operations shared by every service: logging (text or JSON, the rid on request lines), a
periodic scheduler stats line, per-service Prometheus endpoints and OpenTelemetry tracing."""
