"""Sidecar tests use the end-to-end tests' task data."""

from tests.e2e.conftest import task_files  # noqa: F401 - a fixture
