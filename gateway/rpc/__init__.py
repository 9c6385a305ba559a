"""The gRPC front (`continuum.v1.Generation`, health, reflection), built here, bound and
started by gateway/app.py; calls go through gateway/admit/ and gateway/routing/."""
