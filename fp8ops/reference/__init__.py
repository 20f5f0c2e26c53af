"""FP32 reference implementations of every fp8ops op: the executable specification.

Each module ``fp8ops.reference.<stem>`` has functions with the signature of the public op they
specify, written directly from the equations in float32 PyTorch, with FP8 emulated by
saturate-then-cast to torch's float8 dtypes. Import the modules directly::

    from fp8ops.reference import quantize as ref_quantize
"""
