"""Readers for everything lorascope analyses: run directories and the artifacts users
already have. Each returns plain data; ``Evidence`` bundles it for the detectors."""
