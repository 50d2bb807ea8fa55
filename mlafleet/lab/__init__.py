"""The lab: containers standing in for GPU hosts, the models they serve, the stand-in apt repository.

Test and demo only: no production module imports anything here (tests/test_layout.py checks).
"""
