"""bfloat16 without ml_dtypes at import: ml_dtypes (about a second of CPU to import) is loaded
by the first use of bfloat16 (``ops.bfloat16``), and the dtype tables hold it from then on."""

import subprocess
import sys
import textwrap


def run(code):
    output = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True,
                            capture_output=True, text=True)
    return output.stdout.split()


def test_the_bindings_import_without_ml_dtypes_and_a_void_dtype_does_not_load_it():
    assert run("""
        import sys
        import numpy as np
        import hororing.torch
        from hororing import ops
        print("ml_dtypes" in sys.modules)
        print(ops.is_bfloat16(np.dtype("V2")), ops.is_floating("V2"), "ml_dtypes" in sys.modules)
        print(ops.numpy_dtype("float16") == np.float16, "ml_dtypes" in sys.modules)
    """) == ["False", "False", "False", "False", "True", "False"]


def test_the_name_loads_it_and_the_tables_then_hold_it():
    assert run("""
        import sys
        import numpy as np
        from hororing import ops
        dtype = ops.numpy_dtype("bfloat16")
        print("ml_dtypes" in sys.modules, dtype.name, ops.DTYPE_NAMES[dtype], ops.CARRIED_AS[dtype])
        print(np.dtype("bfloat16") is dtype, ops.is_bfloat16(dtype), ops.is_floating(dtype))
        print(ops.BFLOAT16 is dtype, "bfloat16" in [d.name for d in ops.supported_dtypes()])
    """) == ["True", "bfloat16", "bfloat16", "uint16", "True", "True", "True", "True", "True"]


def test_an_array_of_the_users_ml_dtypes_is_taken_at_the_door_and_sent_as_its_bits():
    assert run("""
        import ml_dtypes
        import numpy as np
        from hororing import transport, validate
        array = np.ones(3, dtype=ml_dtypes.bfloat16)
        print(validate.check_array(array) is array, transport.sendable(array).dtype)
        try:
            validate.check_array(np.ones(3, dtype="V2"))
        except TypeError as error:
            print("bfloat16" in str(error) and "unsupported dtype" in str(error))
    """) == ["True", "uint16", "True"]
