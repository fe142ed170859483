/* JPEG decoding and encoding a band of rows at a time, on libjpeg's scanline API.

A large photo's downscale is decode, resample, encode. simplejpeg (TurboJPEG) decodes and
encodes whole pictures only, so the resample and the encode had to wait for the decode to end.
Here the caller takes rows as libjpeg hands them over (at a DCT scale: 1/2, 1/4, 1/8) and
feeds the encoder rows as they are resampled, so both run on another core behind the decode.

Strict, as the intake wants: any warning from libjpeg (truncated data, corrupt entropy data,
extraneous bytes) is an error. Each call that decodes or encodes releases the GIL; an object is
used by one thread at a time (a second one gets RuntimeError, never a crash).

Optional: built where libjpeg's headers are installed (libjpeg62-turbo-dev); without it the
intake keeps to simplejpeg's whole-picture calls (controlplane/imaging/rows.py). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <jpeglib.h>
#include <jerror.h>

/* libjpeg reports an error by calling error_exit, which must not return: jump back to the
   call that started the work, with libjpeg's message kept for the exception. */
typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf escape;
    char message[JMSG_LENGTH_MAX];
} Failure;

static void failure_exit(j_common_ptr cinfo) {
    Failure *failure = (Failure *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, failure->message);
    longjmp(failure->escape, 1);
}

static void failure_message(j_common_ptr cinfo, int level) {
    /* level < 0: a warning (libjpeg would go on with damaged pixels); strict: refuse. Trace
       messages (level >= 0) are ignored. */
    if (level < 0) failure_exit(cinfo);
}

static void failure_quiet(j_common_ptr cinfo) { (void)cinfo; }

/* Whether an object may start a call: set up and not ended (ValueError otherwise), and no other
   thread inside one (RuntimeError). `what`: "decoder" or "encoder". */
static int ready(int live, int busy, const char *what) {
    if (!live) {
        PyErr_Format(PyExc_ValueError, "the %s has finished or failed", what);
        return 0;
    }
    if (busy) {
        PyErr_Format(PyExc_RuntimeError, "the %s is in use by another thread", what);
        return 0;
    }
    return 1;
}

static void failure_init(Failure *failure) {
    jpeg_std_error(&failure->pub);
    failure->pub.error_exit = failure_exit;
    failure->pub.emit_message = failure_message;
    failure->pub.output_message = failure_quiet;
    failure->message[0] = '\0';
}

/* ---------------------------------------------------------------------------------------- */

/* What a decode may cost: its scans (each a pass over every block of a progressive JPEG) and
   the CPU time of the thread decoding it. libjpeg calls the progress monitor once per row of
   blocks read from a scan and once per call that hands rows out, so a decode past its budget
   stops within a row of blocks and its thread is free again. */
typedef struct {
    struct jpeg_progress_mgr pub;
    int max_scans;        /* 0: no limit */
    double cpu_deadline;  /* thread CPU time (s) past which the decode stops; 0: no limit */
    unsigned calls;
    int exceeded;         /* set when the decode stopped for its budget */
} Budget;

static PyObject *TooCostly;

static double thread_cpu_seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

static void budget_check(j_common_ptr cinfo) {
    Budget *budget = (Budget *)cinfo->progress;
    Failure *failure = (Failure *)cinfo->err;
    int scans = ((j_decompress_ptr)cinfo)->input_scan_number;
    if (budget->max_scans > 0 && scans > budget->max_scans) {
        snprintf(failure->message, JMSG_LENGTH_MAX, "more than %d scans", budget->max_scans);
    } else if (budget->cpu_deadline > 0 && (++budget->calls & 15) == 0
               && thread_cpu_seconds() > budget->cpu_deadline) {
        snprintf(failure->message, JMSG_LENGTH_MAX, "decoding took longer than its CPU budget");
    } else {
        return;
    }
    budget->exceeded = 1;
    longjmp(failure->escape, 1);
}

typedef struct {
    PyObject_HEAD
    struct jpeg_decompress_struct cinfo;
    Failure failure;
    Budget budget;
    Py_buffer data;
    int live;     /* cinfo created and not yet destroyed */
    int busy;     /* a call is decoding with the GIL released */
} Decoder;

/* The exception of a decode that failed: TooCostly past its budget, else ValueError. */
static void decoder_failed(Decoder *self) {
    PyErr_Format(self->budget.exceeded ? TooCostly : PyExc_ValueError, "%s", self->failure.message);
}

static void decoder_release(Decoder *self) {
    if (self->live) {
        jpeg_destroy_decompress(&self->cinfo);
        self->live = 0;
    }
    if (self->data.obj != NULL) PyBuffer_Release(&self->data);
}

static int decoder_init(Decoder *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"data", "scale", "grey", "max_scans", "cpu_seconds", NULL};
    int scale = 1, grey = 0, max_scans = 0;
    volatile int failed = 0, colour = 1;  /* set on either side of a longjmp */
    double cpu_seconds = 0;
    Py_buffer data;
    /* The arguments first, into locals: converting them runs Python code, which must find
       this object as it was. */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|ip$id", names, &data, &scale, &grey, &max_scans,
                                     &cpu_seconds)) return -1;
    if (self->busy) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_RuntimeError, "the decoder is in use by another thread");
        return -1;
    }
    if (scale != 1 && scale != 2 && scale != 4 && scale != 8) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "scale must be 1, 2, 4 or 8");
        return -1;
    }
    if (data.len <= 0 || (unsigned long long)data.len > 0xFFFFFFFFull) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "JPEG data is empty or larger than 4 GiB");
        return -1;
    }
    decoder_release(self);
    self->data = data;
    failure_init(&self->failure);
    self->cinfo.err = &self->failure.pub;
    jpeg_create_decompress(&self->cinfo);
    memset(&self->budget, 0, sizeof(self->budget));
    if (max_scans > 0 || cpu_seconds > 0) {
        /* The deadline is on the clock of the thread that decodes: the one calling here and
           read() (one object, one thread at a time). */
        self->budget.pub.progress_monitor = budget_check;
        self->budget.max_scans = max_scans;
        self->budget.cpu_deadline = cpu_seconds > 0 ? thread_cpu_seconds() + cpu_seconds : 0;
        self->cinfo.progress = &self->budget.pub;
    }
    self->live = 1;
    self->busy = 1;
    /* The header, and for a progressive JPEG every scan (libjpeg reads them all before its
       first row), with the GIL released: tens of milliseconds for a large photo. */
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(self->failure.escape)) {
        failed = 1;
    } else {
        jpeg_mem_src(&self->cinfo, (const unsigned char *)self->data.buf, (unsigned long)self->data.len);
        jpeg_read_header(&self->cinfo, TRUE);
        if (self->cinfo.jpeg_color_space != JCS_YCbCr && self->cinfo.jpeg_color_space != JCS_GRAYSCALE
                && self->cinfo.jpeg_color_space != JCS_RGB) {
            colour = 0;
        } else {
            self->cinfo.out_color_space =
                grey || self->cinfo.jpeg_color_space == JCS_GRAYSCALE ? JCS_GRAYSCALE : JCS_RGB;
            self->cinfo.scale_num = 1;
            self->cinfo.scale_denom = (unsigned int)scale;
            self->cinfo.dct_method = JDCT_ISLOW;  /* what TurboJPEG (simplejpeg) uses unless told otherwise */
            jpeg_start_decompress(&self->cinfo);
        }
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (failed || !colour) {
        if (failed) decoder_failed(self);
        else PyErr_SetString(PyExc_ValueError, "only YCbCr, RGB and greyscale JPEGs are decoded here");
        decoder_release(self);
        return -1;
    }
    return 0;
}

static void decoder_dealloc(Decoder *self) {
    decoder_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *decoder_read(Decoder *self, PyObject *args) {
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "w*", &out)) return NULL;
    if (!ready(self->live, self->busy, "decoder")) {
        PyBuffer_Release(&out);
        return NULL;
    }
    size_t stride = (size_t)self->cinfo.output_width * (size_t)self->cinfo.output_components;
    JDIMENSION wanted = (JDIMENSION)((size_t)out.len / stride);
    JDIMENSION left = self->cinfo.output_height - self->cinfo.output_scanline;
    if (wanted > left) wanted = left;
    JDIMENSION done = 0;
    int failed = 0, stalled = 0;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(self->failure.escape)) {
        failed = 1;
    } else {
        while (done < wanted) {
            JSAMPROW rows[16];
            JDIMENSION ask = wanted - done < 16 ? wanted - done : 16, i;
            for (i = 0; i < ask; i++) rows[i] = (JSAMPROW)((unsigned char *)out.buf + (size_t)(done + i) * stride);
            JDIMENSION got = jpeg_read_scanlines(&self->cinfo, rows, ask);
            if (got == 0) {  /* never from a memory source short of an error; never spin on it */
                stalled = 1;
                break;
            }
            done += got;
        }
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyBuffer_Release(&out);
    if (failed || stalled) {
        if (failed) decoder_failed(self);
        else PyErr_SetString(PyExc_ValueError, "the decoder gave no rows");
        decoder_release(self);
        return NULL;
    }
    return PyLong_FromUnsignedLong(done);
}

static PyObject *decoder_finish(Decoder *self, PyObject *unused) {
    (void)unused;
    if (!ready(self->live, self->busy, "decoder")) return NULL;
    if (self->cinfo.output_scanline < self->cinfo.output_height) {
        PyErr_SetString(PyExc_ValueError, "finish() before every row was read");
        return NULL;
    }
    int failed = 0;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(self->failure.escape)) {
        failed = 1;
    } else {
        /* Reads on to the end of the image: a scan after the last one needed, or the EOI
           marker, truncated or corrupt is refused here. */
        jpeg_finish_decompress(&self->cinfo);
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    if (failed) decoder_failed(self);
    decoder_release(self);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyObject *decoder_width(Decoder *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLong(self->live ? self->cinfo.output_width : 0);
}

static PyObject *decoder_height(Decoder *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLong(self->live ? self->cinfo.output_height : 0);
}

static PyObject *decoder_channels(Decoder *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->live ? self->cinfo.output_components : 0);
}

static PyMethodDef decoder_methods[] = {
    {"read", (PyCFunction)decoder_read, METH_VARARGS,
     "read(buffer) -> rows: decode as many whole rows as fit in the writable buffer (fewer at the "
     "end of the picture); ValueError on corrupt or truncated data."},
    {"finish", (PyCFunction)decoder_finish, METH_NOARGS,
     "finish(): read to the end of the image once every row is read; ValueError if what follows "
     "the last row is corrupt or truncated."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef decoder_fields[] = {
    {"width", (getter)decoder_width, NULL, "columns of the decoded picture (at its DCT scale)", NULL},
    {"height", (getter)decoder_height, NULL, "rows of the decoded picture (at its DCT scale)", NULL},
    {"channels", (getter)decoder_channels, NULL, "3 (RGB) or 1 (grey)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "controlplane.imaging._jpegrows.Decoder",
    .tp_basicsize = sizeof(Decoder),
    .tp_dealloc = (destructor)decoder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Decoder(data, scale=1, grey=False, *, max_scans=0, cpu_seconds=0): a JPEG decoded at "
              "1/scale, its rows read in bands; TooCostly once it reads more than max_scans scans or "
              "takes more than cpu_seconds of its thread's CPU time (0: no limit).",
    .tp_methods = decoder_methods,
    .tp_getset = decoder_fields,
    .tp_init = (initproc)decoder_init,
    .tp_new = PyType_GenericNew,
};

/* ---------------------------------------------------------------------------------------- */

/* The compressed bytes go to a buffer this object owns, grown by doubling. */
typedef struct {
    struct jpeg_destination_mgr pub;
    unsigned char *buffer;
    size_t capacity;
    size_t size;
} Sink;

static void sink_init(j_compress_ptr cinfo) {
    Sink *sink = (Sink *)cinfo->dest;
    if (sink->buffer == NULL) {
        sink->capacity = 65536;
        sink->buffer = malloc(sink->capacity);
        if (sink->buffer == NULL) ERREXIT1(cinfo, JERR_OUT_OF_MEMORY, 0);
    }
    sink->pub.next_output_byte = sink->buffer;
    sink->pub.free_in_buffer = sink->capacity;
}

static boolean sink_grow(j_compress_ptr cinfo) {
    Sink *sink = (Sink *)cinfo->dest;
    unsigned char *grown = realloc(sink->buffer, sink->capacity * 2);
    if (grown == NULL) ERREXIT1(cinfo, JERR_OUT_OF_MEMORY, 1);
    sink->buffer = grown;
    sink->pub.next_output_byte = grown + sink->capacity;
    sink->pub.free_in_buffer = sink->capacity;
    sink->capacity *= 2;
    return TRUE;
}

static void sink_term(j_compress_ptr cinfo) {
    Sink *sink = (Sink *)cinfo->dest;
    sink->size = sink->capacity - sink->pub.free_in_buffer;
}

typedef struct {
    PyObject_HEAD
    struct jpeg_compress_struct cinfo;
    Failure failure;
    Sink sink;
    int live;
    int busy;
} Encoder;

static void encoder_release(Encoder *self) {
    if (self->live) {
        jpeg_destroy_compress(&self->cinfo);
        self->live = 0;
    }
    free(self->sink.buffer);
    memset(&self->sink, 0, sizeof(self->sink));
}

static int encoder_init(Encoder *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"width", "height", "quality", NULL};
    int width, height, quality = 85;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the encoder is in use by another thread");
        return -1;
    }
    encoder_release(self);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ii|i", names, &width, &height, &quality)) return -1;
    if (width < 1 || height < 1 || width > JPEG_MAX_DIMENSION || height > JPEG_MAX_DIMENSION) {
        PyErr_SetString(PyExc_ValueError, "width and height must be within 1..65500");
        return -1;
    }
    if (quality < 1 || quality > 100) {
        PyErr_SetString(PyExc_ValueError, "quality must be within 1..100");
        return -1;
    }
    failure_init(&self->failure);
    self->cinfo.err = &self->failure.pub;
    if (setjmp(self->failure.escape)) {
        PyErr_Format(PyExc_ValueError, "%s", self->failure.message);
        encoder_release(self);
        return -1;
    }
    jpeg_create_compress(&self->cinfo);
    self->live = 1;
    self->sink.pub.init_destination = sink_init;
    self->sink.pub.empty_output_buffer = sink_grow;
    self->sink.pub.term_destination = sink_term;
    self->cinfo.dest = &self->sink.pub;
    self->cinfo.image_width = (JDIMENSION)width;
    self->cinfo.image_height = (JDIMENSION)height;
    self->cinfo.input_components = 3;
    self->cinfo.in_color_space = JCS_RGB;
    /* As simplejpeg's encode_jpeg(quality, colorsubsampling="420", fastdct=False): baseline,
       YCbCr 4:2:0, the standard tables scaled to the quality, the accurate DCT. */
    jpeg_set_defaults(&self->cinfo);
    jpeg_set_quality(&self->cinfo, quality, TRUE);
    self->cinfo.comp_info[0].h_samp_factor = 2;
    self->cinfo.comp_info[0].v_samp_factor = 2;
    self->cinfo.dct_method = JDCT_ISLOW;
    jpeg_start_compress(&self->cinfo, TRUE);
    return 0;
}

static void encoder_dealloc(Encoder *self) {
    encoder_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *encoder_write(Encoder *self, PyObject *args) {
    Py_buffer rows_in;
    if (!PyArg_ParseTuple(args, "y*", &rows_in)) return NULL;
    if (!ready(self->live, self->busy, "encoder")) {
        PyBuffer_Release(&rows_in);
        return NULL;
    }
    size_t stride = (size_t)self->cinfo.image_width * 3;
    if ((size_t)rows_in.len % stride != 0) {
        PyBuffer_Release(&rows_in);
        PyErr_SetString(PyExc_ValueError, "the buffer must hold whole rows of RGB");
        return NULL;
    }
    JDIMENSION count = (JDIMENSION)((size_t)rows_in.len / stride);
    if (count > self->cinfo.image_height - self->cinfo.next_scanline) {
        PyBuffer_Release(&rows_in);
        PyErr_SetString(PyExc_ValueError, "more rows than the picture has left");
        return NULL;
    }
    JDIMENSION done = 0;
    int failed = 0, stalled = 0;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    if (setjmp(self->failure.escape)) {
        failed = 1;
    } else {
        while (done < count) {
            JSAMPROW rows[16];
            JDIMENSION ask = count - done < 16 ? count - done : 16, i;
            for (i = 0; i < ask; i++) rows[i] = (JSAMPROW)((unsigned char *)rows_in.buf + (size_t)(done + i) * stride);
            JDIMENSION put = jpeg_write_scanlines(&self->cinfo, rows, ask);
            if (put == 0) {  /* never to a destination that grows, short of an error */
                stalled = 1;
                break;
            }
            done += put;
        }
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyBuffer_Release(&rows_in);
    if (failed || stalled) {
        PyErr_Format(PyExc_ValueError, "%s", failed ? self->failure.message : "the encoder took no rows");
        encoder_release(self);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *encoder_finish(Encoder *self, PyObject *unused) {
    (void)unused;
    if (!ready(self->live, self->busy, "encoder")) return NULL;
    if (self->cinfo.next_scanline < self->cinfo.image_height) {
        PyErr_SetString(PyExc_ValueError, "finish() before every row was written");
        return NULL;
    }
    if (setjmp(self->failure.escape)) {
        PyErr_Format(PyExc_ValueError, "%s", self->failure.message);
        encoder_release(self);
        return NULL;
    }
    jpeg_finish_compress(&self->cinfo);
    PyObject *result = PyBytes_FromStringAndSize((const char *)self->sink.buffer, (Py_ssize_t)self->sink.size);
    encoder_release(self);
    return result;
}

static PyMethodDef encoder_methods[] = {
    {"write", (PyCFunction)encoder_write, METH_VARARGS,
     "write(rows): compress whole rows of RGB (a bytes-like object of rows * width * 3 bytes)."},
    {"finish", (PyCFunction)encoder_finish, METH_NOARGS,
     "finish() -> bytes: the JPEG, once every row is written."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "controlplane.imaging._jpegrows.Encoder",
    .tp_basicsize = sizeof(Encoder),
    .tp_dealloc = (destructor)encoder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Encoder(width, height, quality=85): a baseline 4:2:0 JPEG written a band of rows at a time.",
    .tp_methods = encoder_methods,
    .tp_init = (initproc)encoder_init,
    .tp_new = PyType_GenericNew,
};

/* ---------------------------------------------------------------------------------------- */

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegrows",
    "JPEG decoding and encoding a band of rows at a time (libjpeg's scanline API).", -1, NULL,
};

PyMODINIT_FUNC PyInit__jpegrows(void) {
    if (PyType_Ready(&DecoderType) < 0 || PyType_Ready(&EncoderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    TooCostly = PyErr_NewExceptionWithDoc("controlplane.imaging._jpegrows.TooCostly",
                                          "A decode stopped past its budget of scans or CPU time.", NULL, NULL);
    if (TooCostly == NULL || PyModule_AddObject(m, "TooCostly", TooCostly) < 0) {
        Py_XDECREF(TooCostly);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(TooCostly);
    Py_INCREF(&DecoderType);
    Py_INCREF(&EncoderType);
    if (PyModule_AddObject(m, "Decoder", (PyObject *)&DecoderType) < 0
            || PyModule_AddObject(m, "Encoder", (PyObject *)&EncoderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "LIBJPEG_VERSION", JPEG_LIB_VERSION);
    return m;
}
