"""GGUF weights on the controller: shard manifests, staging, merging and a ranged HTTP mirror.

The staging and merge code itself is the collection's (plugins/module_utils/weights_stage.py and
gguf_merge.py), imported by its collection name: hosts and controller run the same code.
"""
