"""Environments written in other libraries' own formats (verifiers, OpenEnv), for the adapters' tests."""
