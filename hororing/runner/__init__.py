"""Starting jobs from the outside: hororun's elastic driver and ``hororing.run``.

Nothing in here runs inside a rank's training loop; ranks see only the environment the driver
sets (hororing.elastic.job) and the signals it sends.
"""
