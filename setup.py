"""Build hook: setuptools reads pyproject.toml; compiled extensions are declared here."""

from setuptools import setup

setup()
