"""Migrations: turn other formats (legacy bcolz, npz caches, HDF5, older store versions) into stores.

This folder sits at the top of the repository and installs as ``carraystore.migrations``.
"""
