/* Fast protobuf wire-format scanning for XSpace profiles (parsers/xspace.py).
 *
 * Protobuf itself (runtime-built schema) decodes every small message of an XSpace; this module only walks the
 * wire format of the large repeated parts, so that millions of XEvents land in numpy arrays without one Python
 * object per event. Wire format: https://protobuf.dev/programming-guides/encoding/ ; XSpace field numbers:
 * tsl/profiler/protobuf/xplane.proto (docs/reference/xplane-format.md §2).
 *
 * Every read is bounds-checked and every time is computed with checked arithmetic; malformed input raises
 * ValueError("... at byte N") and never reads past the buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct { const uint8_t *p; const uint8_t *end; int err; } Cur;

enum { E_CORRUPT = 1, E_LONG_STR = 3, E_KEY = 4 };
#define MAX_FIELD (((uint64_t)1 << 29) - 1) /* protobuf's largest field number */

static inline __attribute__((always_inline)) uint64_t rd_varint(Cur *c) {
    if (__builtin_expect(c->p < c->end && !(*c->p & 0x80), 1)) return *c->p++;  /* one byte: most keys, ids */
    uint64_t v = 0; int shift = 0;
    while (c->p < c->end) {
        uint8_t b = *c->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return v;
        shift += 7;
        if (shift > 63) { c->err = E_CORRUPT; return 0; }
    }
    c->err = E_CORRUPT; return 0;
}

/* Read a field key. A key protobuf never writes is an error (E_KEY): field number 0 or above 2^29 - 1, or wire
 * types 3 and 4 (groups, absent from xplane.proto), 6 and 7 (undefined). Without this check a run of zero bytes
 * would read as one empty field per two bytes. */
static inline __attribute__((always_inline)) int rd_key(Cur *c, uint64_t *field, int *wt) {
    uint64_t key = rd_varint(c);
    if (c->err) return 0;
    int w = (int)(key & 7);
    *field = key >> 3; *wt = w;
    /* one branch: field - 1 wraps for field 0; bits 0, 1, 2 and 5 of 0x27 are the wire types protobuf writes */
    if (__builtin_expect(((key >> 3) - 1) >= MAX_FIELD || !((0x27 >> w) & 1), 0)) { c->err = E_KEY; return 0; }
    return 1;
}

/* Skip one field's value of the given wire type; returns payload start/end for length-delimited. */
static inline __attribute__((always_inline)) int skip_value(Cur *c, int wt, const uint8_t **ps, const uint8_t **pe) {
    uint64_t n;
    switch (wt) {
    case 0: rd_varint(c); return !c->err;
    case 1: if (c->end - c->p < 8) return 0; c->p += 8; return 1;
    case 5: if (c->end - c->p < 4) return 0; c->p += 4; return 1;
    case 2:
        n = rd_varint(c);
        if (c->err || n > (uint64_t)(c->end - c->p)) return 0;
        if (ps) *ps = c->p;
        c->p += n;
        if (pe) *pe = c->p;
        return 1;
    default: return 0;
    }
}

/* Set ValueError for a Cur error at byte `at` of the buffer. */
static void set_wire_error(int err, Py_ssize_t at) {
    if (err == E_KEY)
        PyErr_Format(PyExc_ValueError, "field key with field number 0 or an impossible wire type at byte %zd", at);
    else if (err == E_LONG_STR)
        PyErr_Format(PyExc_ValueError, "an event stat string longer than 16 MiB at byte %zd", at);
    else PyErr_Format(PyExc_ValueError, "wire format is corrupt or truncated at byte %zd", at);
}

/* 1 when buf[start:end] is inside the buffer; else releases buf, sets ValueError and returns 0 */
static int range_ok(Py_buffer *buf, Py_ssize_t start, Py_ssize_t end) {
    if (start < 0 || end > buf->len || start > end) {
        PyBuffer_Release(buf);
        PyErr_SetString(PyExc_ValueError, "range outside the buffer");
        return 0;
    }
    return 1;
}

/* scan_fields(buf, start, end[, field[, limit]]) -> list of (field, wire_type, tag_start, value_start, value_end,
 * varint) for every top-level field of buf[start:end], or only those numbered `field` (the others are checked and
 * skipped, so that the list grows with the fields the caller wants, not with the input's size); more than `limit`
 * of them is a ValueError. */
static PyObject *scan_fields(PyObject *self, PyObject *args) {
    Py_buffer buf; Py_ssize_t start, end, limit = PY_SSIZE_T_MAX; long long only = -1;
    if (!PyArg_ParseTuple(args, "y*nn|Ln", &buf, &start, &end, &only, &limit) || !range_ok(&buf, start, end))
        return NULL;
    const uint8_t *base = (const uint8_t *)buf.buf;
    Cur c = {base + start, base + end, 0};
    PyObject *out = PyList_New(0);
    const uint8_t *tag_start = c.p;
    while (out && c.p < c.end) {
        tag_start = c.p;
        uint64_t field; int wt;
        if (!rd_key(&c, &field, &wt)) break;
        const uint8_t *vs = c.p, *ve = NULL; uint64_t iv = 0;
        if (wt == 0) { iv = rd_varint(&c); if (c.err) break; }
        else if (!skip_value(&c, wt, &vs, &ve)) { c.err = E_CORRUPT; break; }
        if (wt != 2) ve = c.p;
        if (only >= 0 && field != (uint64_t)only) continue;
        if (PyList_GET_SIZE(out) >= limit) {
            Py_CLEAR(out);
            PyBuffer_Release(&buf);
            PyErr_Format(PyExc_ValueError, "more than %zd fields numbered %lld", limit, only);
            return NULL;
        }
        PyObject *t = Py_BuildValue("(Kinnnn)", (unsigned long long)field, wt, (Py_ssize_t)(tag_start - base),
                                    (Py_ssize_t)(vs - base), (Py_ssize_t)(ve - base), (Py_ssize_t)(int64_t)iv);
        if (!t || PyList_Append(out, t) < 0) { Py_XDECREF(t); Py_CLEAR(out); break; }
        Py_DECREF(t);
    }
    PyBuffer_Release(&buf);
    if (out && c.err) {
        Py_DECREF(out);
        set_wire_error(c.err, (Py_ssize_t)(tag_start - base));
        return NULL;
    }
    return out;
}

enum { K_ABSENT = 0, K_INT = 1, K_UINT = 2, K_DOUBLE = 3, K_REF = 4, K_STR = 5, K_BYTES = 6, K_ZSTR = 7 };
#define STR_LEN_BITS 24
#define AGGREGATE_START INT64_MIN
/* start_ps of events whose times are impossible (they are counted, and dropped by the caller) */
#define BAD_START (INT64_MIN + 1)          /* start outside +-TIME_LIMIT_PS, or line_ps + offset_ps overflows */
#define BAD_NEGATIVE_DURATION (INT64_MIN + 2)
#define BAD_LONG_DURATION (INT64_MIN + 3)  /* duration above DURATION_LIMIT_PS */
#define TIME_LIMIT_PS ((int64_t)1 << 62)   /* 53 days: profile times are relative to the capture's start */
#define DURATION_LIMIT_PS ((int64_t)1 << 60) /* 13.3 days */
#define WANT_TABLE 1024                    /* stat ids below this find their column by a table */
#define KEEP_TABLE 4096                    /* metadata ids below this find whether they are kept by a table */

/* decode_events(buf, start, end, line_timestamp_ns, stat_ids, first, metadata_id, start_ps, duration_ps, values,
 *               kinds[, keep_ids, keep_columns]) -> (events written, events with impossible times, stop)
 *
 * Decodes the XEvents (XLine field 4) of the line whose payload is buf[start:end] into rows first.. of the
 * output arrays, until they are full: `stop` is the byte where decoding stopped, `end` once the whole line is
 * decoded, else the first event that found no row (call again from there, with rows free), so that a line of
 * millions of events is decoded a batch of rows at a time. Output arrays: metadata_id/start_ps/duration_ps
 * int64[n]; values int64[ncol*n] and kinds int8[ncol*n], laid out column-major (column j at j*n). stat_ids
 * int64[ncol] are the XStatMetadata ids wanted; other stats are skipped.
 * start_ps = line_timestamp_ns * 1000 + offset_ps (checked arithmetic), or INT64_MIN for aggregated events
 * (num_occurrences; then duration_ps holds the duration and the value is not a time). An event whose start
 * overflows or lies outside +-2^62 ps, or whose duration is negative or above 2^60 ps, gets start_ps
 * BAD_START / BAD_NEGATIVE_DURATION / BAD_LONG_DURATION (INT64_MIN + 1/2/3) and is counted in the second value.
 * Values: ints as int64, uint64 bit-cast, doubles bit-cast, ref_value as the referenced XStatMetadata id,
 * strings/bytes as (payload offset << 24 | length).
 * With keep_ids (int64, sorted: XEventMetadata ids) and keep_columns (int64: columns, 0..ncol-1), only the events
 * whose metadata id is in keep_ids, that carry a stat of one of keep_columns, or whose times are impossible are
 * written (one after another from row `first`; the row after the last one written, and the value of a stat a
 * written event lacks (kind 0), may hold a dropped event's), so that a caller wanting a few events of many copies
 * none of the others.
 */
static PyObject *decode_events(PyObject *self, PyObject *args) {
    Py_buffer buf, ids, mid, st, du, val, kin, kid = {0}, kcol = {0};
    Py_ssize_t start, end, first; long long line_ns;
    if (!PyArg_ParseTuple(args, "y*nnLy*nw*w*w*w*w*|y*y*", &buf, &start, &end, &line_ns, &ids, &first,
                          &mid, &st, &du, &val, &kin, &kid, &kcol)) return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = mid.len / 8, ncol = ids.len / 8;
    const int filter = kid.obj != NULL;
    const int64_t *keep_ids = (const int64_t *)kid.buf, *keep_cols = (const int64_t *)kcol.buf;
    const Py_ssize_t nkeep = filter ? kid.len / 8 : 0, nkcol = filter && kcol.obj != NULL ? kcol.len / 8 : 0;
    if (start < 0 || end > buf.len || start > end || st.len / 8 != n || du.len / 8 != n ||
        val.len / 8 != n * ncol || kin.len != n * ncol || first < 0 || buf.len >= ((Py_ssize_t)1 << 39)) {
        PyErr_SetString(PyExc_ValueError, "decode_events: bad range or output sizes");
        goto done;
    }
    for (Py_ssize_t k = 0; k < nkcol; k++) {
        if (keep_cols[k] < 0 || keep_cols[k] >= ncol) {
            PyErr_SetString(PyExc_ValueError, "decode_events: a keep column outside the columns");
            goto done;
        }
    }
    for (Py_ssize_t k = 1; k < nkeep; k++) {
        if (keep_ids[k - 1] > keep_ids[k]) {
            PyErr_SetString(PyExc_ValueError, "decode_events: keep_ids are not sorted");
            goto done;
        }
    }
    {
        uint8_t keep_small[KEEP_TABLE] = {0}; /* whether metadata id i (below KEEP_TABLE) is in keep_ids */
        for (Py_ssize_t k = 0; k < nkeep; k++)
            if (keep_ids[k] >= 0 && keep_ids[k] < KEEP_TABLE) keep_small[keep_ids[k]] = 1;
        const uint8_t *base = (const uint8_t *)buf.buf;
        const int64_t *want = (const int64_t *)ids.buf;
        /* column of each wanted stat id below WANT_TABLE (+1; 0: not wanted; the first column of an id wins), so
         * that a stat finds its column in one load; ids beyond the table are looked up in `want` */
        int16_t col_of[WANT_TABLE] = {0};
        int all_in_table = ncol < INT16_MAX;
        for (Py_ssize_t j = ncol - 1; j >= 0 && all_in_table; j--) {
            if (want[j] >= 0 && want[j] < WANT_TABLE) col_of[want[j]] = (int16_t)(j + 1);
            else all_in_table = 0;
        }
        int64_t *o_mid = (int64_t *)mid.buf, *o_st = (int64_t *)st.buf, *o_du = (int64_t *)du.buf;
        int64_t *o_val = (int64_t *)val.buf; int8_t *o_kin = (int8_t *)kin.buf;
        int64_t line_ps;
        int line_bad = __builtin_mul_overflow((int64_t)line_ns, (int64_t)1000, &line_ps);
        Cur c = {base + start, base + end, 0};
        const uint8_t *err_at = c.p;
        Py_ssize_t row = first, bad = 0;
        const uint8_t *stop = c.end;
        while (c.p < c.end) {
            uint64_t key_f; int key_wt;
            err_at = c.p;
            if (!rd_key(&c, &key_f, &key_wt)) break;
            const uint8_t *es, *ee;
            if (key_f != 4 || key_wt != 2) {
                if (!skip_value(&c, key_wt, NULL, NULL)) { c.err = E_CORRUPT; break; }
                continue;
            }
            if (!skip_value(&c, 2, &es, &ee)) { c.err = E_CORRUPT; break; }
            if (row >= n) { stop = err_at; break; }  /* no row left: the caller goes on from this event */
            int64_t e_mid = 0, e_off = 0, e_dur = 0; int aggregate = 0;
            for (Py_ssize_t j = 0; j < ncol; j++) o_kin[j * n + row] = K_ABSENT;
            Cur e = {es, ee, 0};
            while (e.p < e.end) {
                uint64_t f; int wt;
                err_at = e.p;
                if (!rd_key(&e, &f, &wt)) break;
                if (wt == 0 && (f == 1 || f == 2 || f == 3 || f == 5)) {
                    int64_t v = (int64_t)rd_varint(&e);
                    if (f == 1) e_mid = v; else if (f == 2) { e_off = v; aggregate = 0; }
                    else if (f == 3) e_dur = v; else aggregate = 1;
                    continue;
                }
                const uint8_t *ss, *se;
                if (f != 4 || wt != 2) {
                    if (!skip_value(&e, wt, NULL, NULL)) { e.err = E_CORRUPT; break; }
                    continue;
                }
                if (!skip_value(&e, 2, &ss, &se)) { e.err = E_CORRUPT; break; }
                /* XStat */
                Cur s = {ss, se, 0};
                int64_t s_mid = 0, s_val = 0; int s_kind = K_ABSENT;
                while (s.p < s.end) {
                    uint64_t sf; int swt;
                    err_at = s.p;
                    if (!rd_key(&s, &sf, &swt)) break;
                    if (swt == 0) {
                        uint64_t v = rd_varint(&s);
                        if (sf == 1) s_mid = (int64_t)v;
                        else if (sf == 3) { s_val = (int64_t)v; s_kind = K_UINT; }
                        else if (sf == 4) { s_val = (int64_t)v; s_kind = K_INT; }
                        else if (sf == 7) { s_val = (int64_t)v; s_kind = K_REF; }
                    } else if (swt == 1) {
                        if (s.end - s.p < 8) { s.err = E_CORRUPT; break; }
                        if (sf == 2) { memcpy(&s_val, s.p, 8); s_kind = K_DOUBLE; }
                        s.p += 8;
                    } else if (swt == 2) {
                        const uint8_t *vs, *ve;
                        if (!skip_value(&s, 2, &vs, &ve)) { s.err = E_CORRUPT; break; }
                        if (sf == 5 || sf == 6 || sf == 8) {
                            int64_t len = ve - vs;
                            if (len >= ((int64_t)1 << STR_LEN_BITS)) { s.err = E_LONG_STR; break; }
                            s_val = ((int64_t)(vs - base) << STR_LEN_BITS) | len;
                            s_kind = sf == 5 ? K_STR : (sf == 6 ? K_BYTES : K_ZSTR);
                        }
                    } else if (!skip_value(&s, swt, NULL, NULL)) { s.err = E_CORRUPT; break; }
                }
                if (s.err) { e.err = s.err; break; }
                if (all_in_table) {
                    Py_ssize_t j = (s_mid >= 0 && s_mid < WANT_TABLE) ? col_of[s_mid] - 1 : -1;
                    if (j >= 0) { o_val[j * n + row] = s_val; o_kin[j * n + row] = (int8_t)s_kind; }
                } else {
                    for (Py_ssize_t j = 0; j < ncol; j++) {
                        if (want[j] == s_mid) {
                            o_val[j * n + row] = s_val; o_kin[j * n + row] = (int8_t)s_kind; break;
                        }
                    }
                }
            }
            if (e.err) { c.err = e.err; break; }
            int64_t t;
            if (e_dur < 0) t = BAD_NEGATIVE_DURATION;
            else if (e_dur > DURATION_LIMIT_PS) t = BAD_LONG_DURATION;
            else if (aggregate) t = AGGREGATE_START;
            else if (line_bad || __builtin_add_overflow(line_ps, e_off, &t) || t > TIME_LIMIT_PS || t < -TIME_LIMIT_PS)
                t = BAD_START;
            int impossible = t > AGGREGATE_START && t <= BAD_LONG_DURATION;
            bad += impossible;
            o_mid[row] = e_mid;
            o_st[row] = t;
            o_du[row] = e_dur;
            int keep = !filter || impossible;  /* impossible times are kept: the caller counts and drops them */
            if (!keep) {
                if (e_mid >= 0 && e_mid < KEEP_TABLE) keep = keep_small[e_mid];
                else {  /* binary search of the sorted ids */
                    Py_ssize_t lo = 0, hi = nkeep;
                    while (lo < hi) {
                        Py_ssize_t m = lo + (hi - lo) / 2;
                        if (keep_ids[m] < e_mid) lo = m + 1; else hi = m;
                    }
                    keep = lo < nkeep && keep_ids[lo] == e_mid;
                }
            }
            for (Py_ssize_t k = 0; !keep && k < nkcol; k++) keep = o_kin[keep_cols[k] * n + row] != K_ABSENT;
            row += keep;
        }
        if (c.err) set_wire_error(c.err, (Py_ssize_t)(err_at - base));
        else ret = Py_BuildValue("(nnn)", row - first, bad, (Py_ssize_t)(stop - base));
    }
done:
    PyBuffer_Release(&buf); PyBuffer_Release(&ids); PyBuffer_Release(&mid); PyBuffer_Release(&st);
    PyBuffer_Release(&du); PyBuffer_Release(&val); PyBuffer_Release(&kin);
    if (kid.obj) PyBuffer_Release(&kid);
    if (kcol.obj) PyBuffer_Release(&kcol);
    return ret;
}

/* split_fields(buf, start, end, field) -> (bytes of every top-level field except `field`, occurrences of it)
 * Used to parse a message's small fields with protobuf while its big repeated field stays in the buffer. */
static PyObject *split_fields(PyObject *self, PyObject *args) {
    Py_buffer buf; Py_ssize_t start, end; unsigned long long want;
    if (!PyArg_ParseTuple(args, "y*nnK", &buf, &start, &end, &want) || !range_ok(&buf, start, end)) return NULL;
    const uint8_t *base = (const uint8_t *)buf.buf;
    Cur c = {base + start, base + end, 0};
    Py_ssize_t n = 0, total = 0;
    const uint8_t *tag = c.p;
    /* pass 1: size of the kept fields */
    while (c.p < c.end) {
        uint64_t field; int wt;
        tag = c.p;
        if (!rd_key(&c, &field, &wt)) break;
        if (!skip_value(&c, wt, NULL, NULL)) { c.err = E_CORRUPT; break; }
        if (field == want) n++; else total += c.p - tag;
    }
    if (c.err) {
        PyBuffer_Release(&buf); set_wire_error(c.err, (Py_ssize_t)(tag - base)); return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (!out) { PyBuffer_Release(&buf); return NULL; }
    char *dst = PyBytes_AS_STRING(out);
    Cur d = {base + start, base + end, 0};
    while (d.p < d.end) {  /* pass 2 reads what pass 1 checked */
        uint64_t field = 0; int wt = 0;
        tag = d.p;
        rd_key(&d, &field, &wt);
        skip_value(&d, wt, NULL, NULL);
        if (field != want) { memcpy(dst, tag, d.p - tag); dst += d.p - tag; }
    }
    PyBuffer_Release(&buf);
    PyObject *ret = Py_BuildValue("(Nn)", out, n);
    return ret;
}

static PyMethodDef methods[] = {
    {"split_fields", split_fields, METH_VARARGS, "Bytes of all fields but one, and that field's count."},
    {"scan_fields", scan_fields, METH_VARARGS, "List the top-level fields of buf[start:end] (or those of one number)."},
    {"decode_events", decode_events, METH_VARARGS, "Decode an XLine's events into arrays."},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wirescan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wirescan(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObject(m, "TIME_LIMIT_PS", PyLong_FromLongLong(TIME_LIMIT_PS)) < 0 ||
        PyModule_AddObject(m, "DURATION_LIMIT_PS", PyLong_FromLongLong(DURATION_LIMIT_PS)) < 0) {
        Py_DECREF(m); return NULL;
    }
    return m;
}
