# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The strict per-line Criteo TSV parser, compiled: which lines of a block are
valid examples, and their values.

hps.data.criteo._parse_line is the reference definition of a valid line; this
is the same rule set in C, for the blocks pyarrow's parser cannot take (a bad
line, a space, an "x", a byte order mark, a lone "\\r"). A valid line has 40
tab-separated fields: label 0 or 1 written as -?[0-9]+; I1..I13 empty or
-?[0-9]+ within int64; C1..C26 empty or 1 to 16 hexadecimal digits. It only
says valid or not: the reader asks _parse_line why a line is invalid, so the
messages have one source. tests/test_data_fuzz.py holds the two to the same
verdicts and values.
"""
from libc.stdint cimport int64_t, uint8_t, uint64_t

cdef enum:
    N_FIELDS = 40
    N_DENSE = 13
    N_CAT = 26


cdef inline bint _is_digit(uint8_t c) noexcept nogil:
    return c >= 48 and c <= 57  # '0'..'9'


cdef inline int _hex_value(uint8_t c) noexcept nogil:
    if c >= 48 and c <= 57:
        return c - 48
    if c >= 97 and c <= 102:  # 'a'..'f'
        return c - 87
    if c >= 65 and c <= 70:  # 'A'..'F'
        return c - 55
    return -1


cdef bint _integer(const uint8_t[:] s, Py_ssize_t a, Py_ssize_t z, double* out) noexcept nogil:
    """-?[0-9]+ within int64 in s[a:z], as a double (rounded as Python's int -> float)."""
    cdef bint negative = False
    cdef uint64_t magnitude = 0
    cdef uint64_t limit
    cdef Py_ssize_t i
    cdef int digit
    if a < z and s[a] == 45:  # '-'
        negative = True
        a += 1
    if a >= z:
        return False
    limit = (<uint64_t>1 << 63) if negative else ((<uint64_t>1 << 63) - 1)
    for i in range(a, z):
        if not _is_digit(s[i]):
            return False
        digit = s[i] - 48
        # magnitude * 10 + digit <= limit, without overflowing: leading zeros of any count pass
        if magnitude > (limit - <uint64_t>digit) // 10:
            # out of range; but the rest must still be digits for the verdict to be "range", not "digits":
            # either way the line is invalid, which is all this function says
            return False
        magnitude = magnitude * 10 + <uint64_t>digit
    if negative:
        if magnitude == (<uint64_t>1 << 63):
            out[0] = <double>(<int64_t>(-9223372036854775807 - 1))
        else:
            out[0] = <double>(-<int64_t>magnitude)
    else:
        out[0] = <double>(<int64_t>magnitude)
    return True


cdef bint _line(const uint8_t[:] s, Py_ssize_t a, Py_ssize_t z, Py_ssize_t row, double[:] labels,
                double[:, :] dense, uint64_t[:, :] cats, uint8_t[:, :] absent) noexcept nogil:
    cdef Py_ssize_t bounds[N_FIELDS + 1]
    cdef Py_ssize_t n = 0, i, f, fa, fz
    cdef double value
    cdef uint64_t hexv
    cdef int d
    bounds[0] = a
    for i in range(a, z):
        if s[i] == 9:  # '\t'
            n += 1
            if n >= N_FIELDS:
                return False
            bounds[n] = i + 1
    if n != N_FIELDS - 1:
        return False
    bounds[N_FIELDS] = z + 1  # each field ends one before the next field's start
    # label: -?[0-9]+ whose value is 0 or 1
    if not _integer(s, bounds[0], bounds[1] - 1, &value) or (value != 0.0 and value != 1.0):
        return False
    labels[row] = value
    for f in range(N_DENSE):
        fa = bounds[1 + f]
        fz = bounds[2 + f] - 1
        if fa == fz:
            dense[row, f] = 0.0
        elif _integer(s, fa, fz, &value):
            dense[row, f] = value
        else:
            return False
    for f in range(N_CAT):
        fa = bounds[1 + N_DENSE + f]
        fz = bounds[2 + N_DENSE + f] - 1
        if fa == fz:
            absent[row, f] = 1
            cats[row, f] = 0
            continue
        if fz - fa > 16:
            return False
        hexv = 0
        for i in range(fa, fz):
            d = _hex_value(s[i])
            if d < 0:
                return False
            hexv = (hexv << 4) | <uint64_t>d
        absent[row, f] = 0
        cats[row, f] = hexv
    return True


def parse_lines(const uint8_t[:] block, const int64_t[:] starts, const int64_t[:] ends, double[:] labels,
                double[:, :] dense, uint64_t[:, :] cats, uint8_t[:, :] absent, uint8_t[:] valid):
    """Parses lines block[starts[i]:ends[i]] (without their line ends) into row i of
    labels (n,), dense (n, 13; raw counts, 0 for missing), cats (n, 26) and absent
    (n, 26); valid[i] says whether line i is a valid example (its row is then set).
    Returns the number of valid lines."""
    cdef Py_ssize_t i, n = starts.shape[0], good = 0
    if not (ends.shape[0] == labels.shape[0] == dense.shape[0] == cats.shape[0] == absent.shape[0]
            == valid.shape[0] == n):
        raise ValueError("parse_lines: starts, ends and the outputs must have one entry a line")
    if dense.shape[1] != N_DENSE or cats.shape[1] != N_CAT or absent.shape[1] != N_CAT:
        raise ValueError("parse_lines: dense must have 13 columns, cats and absent 26")
    with nogil:
        for i in range(n):
            valid[i] = _line(block, starts[i], ends[i], i, labels, dense, cats, absent)
            good += valid[i]
    return good
