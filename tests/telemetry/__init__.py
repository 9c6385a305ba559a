"""Tests of issue 17's telemetry store, continuum report and continuum gate."""
