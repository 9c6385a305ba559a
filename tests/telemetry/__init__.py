"""Tests of the telemetry store, continuum report and continuum gate."""
