# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The libsvm / libFM / libFFM line parser, compiled: which lines of a block are
examples, blank or malformed, and their labels, indices and values.

hps.data.tabular.Libsvm._parse_line is the reference definition; this applies the
same rules in C: a "#" starts a comment; ASCII whitespace separates tokens; a line
with no token is blank (skipped); the label is one of 0, 1, -1, +1, 0.0, 1.0; each
feature is index:value or field:index:value (the field left to the schema), the
index [0-9]+ below 2**63, the value what Python's float() reads, finite and inside
float32's range (it is stored as a float32; one that would round to inf is refused). Values are
read by CPython's own PyOS_string_to_double, the function float() calls; a value
with an underscore (which float() also accepts) is handed to float() itself. Only the
verdicts and values come from here: the reader asks _parse_line why a line is bad.
"""
from cpython.ref cimport PyObject
from libc.math cimport fabs, isfinite
from libc.stdint cimport int64_t, uint8_t, uint64_t

import numpy as np

cdef extern from "Python.h":
    # overflow_exception NULL: an overflow gives +-inf (float()'s behaviour), not an error
    double PyOS_string_to_double(const char* s, char** endptr, PyObject* overflow_exception) except? -1.0

# The least magnitude a float32 rounds to inf: FLT_MAX and half its last place
# (a tie, rounded to the even inf). Values are stored as float32.
cdef double F32_OVERFLOW = 2.0 ** 128 - 2.0 ** 103
FLOAT32_OVERFLOW = F32_OVERFLOW

# Line kinds in `kind`.
BLANK, EXAMPLE, BAD = 0, 1, 2


cdef inline bint _space(uint8_t c) noexcept nogil:
    return c == 32 or (c >= 9 and c <= 13)  # bytes.split()'s whitespace: space, \t \n \v \f \r


cdef int _label(const uint8_t[:] s, Py_ssize_t a, Py_ssize_t z) noexcept nogil:
    """0 or 1 for a label token s[a:z], -1 for anything else."""
    cdef Py_ssize_t n = z - a
    if n == 1 and (s[a] == 48 or s[a] == 49):
        return s[a] - 48
    if n == 2 and (s[a] == 45 or s[a] == 43) and s[a + 1] == 49:  # -1 (a negative: 0), +1
        return 0 if s[a] == 45 else 1
    if n == 3 and s[a + 1] == 46 and s[a + 2] == 48 and (s[a] == 48 or s[a] == 49):  # 0.0, 1.0
        return s[a] - 48
    return -1


cdef bint _value(const uint8_t[:] s, Py_ssize_t a, Py_ssize_t z, double* out):
    """float() of s[a:z], finite and inside float32's range; False if it is not a
    number, not finite, or would be inf as a float32."""
    cdef char buf[64]
    cdef char* end
    cdef Py_ssize_t n = z - a, i
    cdef double x
    if n == 0:
        return False
    cdef bint underscore = False
    for i in range(a, z):
        if s[i] == 0:  # float() refuses a NUL
            return False
        underscore |= s[i] == 95
    if underscore or n >= 64:  # float()'s own rules for "1_000"; a long token needs no buffer
        try:
            x = float(bytes(s[a:z]))
        except ValueError:
            return False
        out[0] = x
        return isfinite(x) and fabs(x) < F32_OVERFLOW
    for i in range(n):
        buf[i] = <char>s[a + i]
    buf[n] = 0
    try:
        x = PyOS_string_to_double(buf, &end, NULL)
    except ValueError:
        return False
    if end != buf + n:
        return False
    out[0] = x
    return isfinite(x) and fabs(x) < F32_OVERFLOW


def parse_lines(const uint8_t[:] block, const int64_t[:] starts, const int64_t[:] ends):
    """Lines block[starts[i]:ends[i]] (without their line ends). Returns (kind (n,)
    uint8: BLANK, EXAMPLE or BAD; labels (n,) float32, set for examples; feature_line,
    index, value: one entry a feature of the examples, in line order)."""
    cdef Py_ssize_t n = starts.shape[0], i, a, z, t, ta, tz, colon, kstart, j, colons
    cdef int lab
    cdef uint64_t index
    cdef double x
    cdef bint ok
    if ends.shape[0] != n:
        raise ValueError("parse_lines: starts and ends must have one entry a line")
    kind = np.empty(n, np.uint8)
    labels = np.zeros(n, np.float32)
    cdef uint8_t[:] kind_v = kind
    cdef float[:] label_v = labels
    cap = max(16, (block.shape[0] // 4) + 1)
    f_line = np.empty(cap, np.int64)
    f_index = np.empty(cap, np.int64)
    f_value = np.empty(cap, np.float32)
    cdef int64_t[:] fl = f_line
    cdef int64_t[:] fi = f_index
    cdef float[:] fv = f_value
    cdef Py_ssize_t count = 0, line_first
    for i in range(n):
        a, z = starts[i], ends[i]
        for t in range(a, z):  # a comment runs to the line's end
            if block[t] == 35:
                z = t
                break
        while a < z and _space(block[a]):
            a += 1
        while z > a and _space(block[z - 1]):
            z -= 1
        if a == z:
            kind_v[i] = BLANK
            continue
        ta = a
        while ta < z and not _space(block[ta]):
            ta += 1
        lab = _label(block, a, ta)
        if lab < 0:
            kind_v[i] = BAD
            continue
        line_first = count
        ok = True
        t = ta
        while True:
            while t < z and _space(block[t]):
                t += 1
            if t >= z:
                break
            tz = t
            colon = -1
            colons = 0
            kstart = t
            while tz < z and not _space(block[tz]):
                if block[tz] == 58:  # ':'
                    kstart = colon + 1 if colon >= 0 else t
                    colon = tz
                    colons += 1
                tz += 1
            # no ':', an empty index, or more parts than field:index:value
            if colon < 0 or colon == kstart or colons > 2:
                ok = False
                break
            # the index: [0-9]+ below 2**63 (leading zeros of any count)
            index = 0
            for j in range(kstart, colon):
                if block[j] < 48 or block[j] > 57:
                    ok = False
                    break
                if index > ((<uint64_t>1 << 63) - 1 - <uint64_t>(block[j] - 48)) // 10:
                    ok = False
                    break
                index = index * 10 + <uint64_t>(block[j] - 48)
            if not ok or not _value(block, colon + 1, tz, &x):
                ok = False
                break
            if count == fl.shape[0]:  # grow the feature arrays
                f_line = np.resize(f_line, 2 * count)
                f_index = np.resize(f_index, 2 * count)
                f_value = np.resize(f_value, 2 * count)
                fl, fi, fv = f_line, f_index, f_value
            fl[count] = i
            fi[count] = <int64_t>index
            fv[count] = <float>x
            count += 1
            t = tz
        if ok:
            kind_v[i] = EXAMPLE
            label_v[i] = lab
        else:
            kind_v[i] = BAD
            count = line_first  # the bad line's features are dropped
    return kind, labels, f_line[:count], f_index[:count], f_value[:count]
