"""An object tier (``type: object``): versions in an S3-compatible bucket, the commit object written last.

``tier``: the tier; ``read``: its containers read through the stored tier's checks; ``lease``: one
writing Checkpointer per prefix.
"""
