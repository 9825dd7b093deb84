"""Tests of specdecpp, mirroring the library (core/, models/, ...), the apps (apps/), the demo (demo/)
and the whole pipeline (e2e/); shared helpers in helpers/, shared fixtures in conftest.py."""
