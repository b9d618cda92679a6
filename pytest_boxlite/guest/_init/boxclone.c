/* pytest-boxlite's native way to make a test's box: a pid 1 that shares the warm interpreter's
 * memory instead of copying it (loaded with ctypes by guest/fresh.py; no Python API).
 *
 * box_clone() clones with CLONE_VM and the box's namespace flags onto a private stack.  That
 * child, pid 1 of the new pid namespace, makes the test process with one raw fork (a copy of the
 * warm interpreter, paused in this call), which jumps back into this call's frame and returns 0
 * to Python; pid 1 then executes boxinit (boxinit.c) by descriptor, which releases the shared
 * memory.  The warm interpreter's thread waits in this call until boxinit is sealed, so nothing
 * of the interpreter runs while pid 1 shares its memory (its other threads are blocked in reads:
 * guest/fresh.py calls this with the GIL held, as it calls clone(2)), and pid 1's only copy of the
 * interpreter is the test process's own.
 *
 * A root box's id maps are written here by the caller's thread before pid 1 forks (pid 1 waits
 * for them): pid 1 must be root of its user namespace when it executes boxinit, or execve drops
 * the capabilities it needs to write the test's nested maps.  No CLONE_VFORK for the same reason:
 * the parent has work to do while pid 1 waits; it then waits itself, on the gate pipe.
 *
 * Every signal is blocked around the clone: pid 1 has the interpreter's signal handlers (no
 * CLONE_SIGHAND) until its execve, and one must never run on its stack in the shared memory. */
#undef _FORTIFY_SOURCE /* its longjmp refuses a jump between stacks */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <setjmp.h>

#include "sys.h"

struct box_args {
    long flags;            /* the namespaces (CLONE_NEW*) */
    long init_fd;          /* boxinit, opened for execveat */
    long proc_fd;          /* root: a /proc descriptor of the caller's, to write pid 1's maps; -1: none */
    const char *uid_map;   /* root: pid 1's maps; NULL: none (anyone else maps their own) */
    const char *gid_map;
    unsigned long mask;    /* signals boxinit forwards (bit N-1: signal N) */
    const int *close_fds;  /* what pid 1 must not hold (the box's cell, the mappers' other ends) */
    long n_close;
    long nested_ready;     /* root: the nested mapper's ends boxinit keeps; -1: none */
    long nested_done;
    const char *nested_uid_map;
    const char *nested_gid_map;
    long stage;            /* out: where box_clone stopped, on failure */
};

struct state {
    jmp_buf back;
    struct box_args *a;
    unsigned long old_mask;
    int go[2];   /* root: the caller says the maps are written */
    int gate[2]; /* boxinit says it is sealed (one byte for the caller, one for the test process) */
};

/* pid 1's stack while it shares the interpreter's memory; one box is made at a time (the caller
 * holds the GIL throughout), and pid 1 leaves it at its execve, before box_clone returns. */
static char pid1_stack[64 * 1024] __attribute__((aligned(64)));

__attribute__((noreturn)) static void quit(long code)
{
    for (;;)
        sys1(NR_exit_group, code);
}

static int pid1(void *arg)
{
    struct state *s = arg;
    struct box_args *a = s->a;
    char b;
    if (a->uid_map) {
        sys1(NR_close, s->go[1]);
        if (sys3(NR_read, s->go[0], &b, 1) != 1)
            quit(70); /* the caller could not write the maps */
        sys1(NR_close, s->go[0]);
    }
    long test = sys5(NR_clone, B_SIGCHLD, 0, 0, 0, 0);
    if (test == 0) {
        /* The test process: it goes on only once pid 1 is sealed (or gone), then returns 0 from
         * box_clone with the caller's signal mask. */
        sys1(NR_close, s->gate[1]);
        long n;
        do
            n = sys3(NR_read, s->gate[0], &b, 1);
        while (n == -B_EINTR);
        sys1(NR_close, s->gate[0]);
        sys4(NR_rt_sigprocmask, B_SIG_SETMASK, &s->old_mask, 0, 8);
        longjmp(s->back, 1);
    }
    if (test < 0)
        quit(70);
    if (sys5(NR_prctl, B_PR_SET_PDEATHSIG, B_SIGKILL, 0, 0, 0) != 0)
        quit(70);
    for (long i = 0; i < a->n_close; i++)
        sys1(NR_close, a->close_fds[i]);
    sys1(NR_close, s->gate[0]);
    /* Everything else of the warm interpreter's closes at the exec (close_range's flag: 5.11). */
    sys3(NR_close_range, 3, ~0U, B_CLOSE_RANGE_CLOEXEC);
    if (sys3(NR_fcntl, s->gate[1], B_F_SETFD, 0) != 0)
        quit(70);
    int nested = a->nested_ready >= 0 && a->nested_done >= 0;
    if (nested && (sys3(NR_fcntl, a->nested_ready, B_F_SETFD, 0) != 0 || sys3(NR_fcntl, a->nested_done, B_F_SETFD, 0) != 0))
        quit(70);
    char n_test[21], n_mask[21], n_gate[21], n_ready[21], n_done[21];
    char dash[2] = "-";
    char *argv[9] = {
        "boxinit",
        b_utoa((unsigned long)test, n_test),
        b_utoa(a->mask, n_mask),
        b_utoa((unsigned long)s->gate[1], n_gate),
        nested ? b_utoa((unsigned long)a->nested_ready, n_ready) : dash,
        nested ? b_utoa((unsigned long)a->nested_done, n_done) : dash,
        nested && a->nested_uid_map ? (char *)a->nested_uid_map : dash,
        nested && a->nested_gid_map ? (char *)a->nested_gid_map : dash,
        0,
    };
    char *envp[1] = {0};
    sys5(NR_execveat, a->init_fd, "", argv, envp, B_AT_EMPTY_PATH);
    quit(71); /* no boxinit: the box ends, its test process with it (pid 1 gone) */
}

static int write_map(long proc_fd, long pid, const char *which, const char *data)
{
    char path[48], num[21];
    char *p = path;
    const char *parts[3] = {b_utoa((unsigned long)pid, num), "/", which};
    for (int i = 0; i < 3; i++)
        for (const char *q = parts[i]; *q && p < path + sizeof(path) - 1; q++)
            *p++ = *q;
    *p = 0;
    long fd = sys4(NR_openat, proc_fd, path, B_O_WRONLY | B_O_CLOEXEC, 0);
    if (fd < 0)
        return 0;
    long len = (long)b_strlen(data);
    long n = sys3(NR_write, fd, data, len);
    sys1(NR_close, fd);
    return n == len;
}

/* The box's pid 1 (its pid here) in the caller; 0 in the test process; -errno when no box was
 * made (a->stage says at which step). */
long box_clone(struct box_args *a)
{
    struct state s;
    s.a = a;
    s.go[0] = s.go[1] = -1;
    unsigned long all = ~0UL;
    a->stage = 1;
    long err = sys4(NR_rt_sigprocmask, B_SIG_SETMASK, &all, &s.old_mask, 8);
    if (err)
        return err;
    a->stage = 2;
    err = sys2(NR_pipe2, s.gate, B_O_CLOEXEC);
    if (!err && a->uid_map) {
        err = sys2(NR_pipe2, s.go, B_O_CLOEXEC);
        if (err) {
            sys1(NR_close, s.gate[0]);
            sys1(NR_close, s.gate[1]);
        }
    }
    if (err) {
        sys4(NR_rt_sigprocmask, B_SIG_SETMASK, &s.old_mask, 0, 8);
        return err;
    }
    if (setjmp(s.back))
        return 0; /* the test process */
    a->stage = 3;
    long pid = clone(pid1, pid1_stack + sizeof(pid1_stack), (int)(CLONE_VM | a->flags | B_SIGCHLD), &s);
    if (pid < 0)
        pid = -(long)errno;
    sys1(NR_close, s.gate[1]);
    if (pid > 0 && a->uid_map) {
        a->stage = 4;
        if (write_map(a->proc_fd, pid, "uid_map", a->uid_map) && write_map(a->proc_fd, pid, "gid_map", a->gid_map))
            sys3(NR_write, s.go[1], "g", 1);
    }
    if (a->uid_map) {
        sys1(NR_close, s.go[0]);
        sys1(NR_close, s.go[1]); /* without a "g": pid 1 exits */
    }
    if (pid > 0) {
        char b;
        long n;
        do
            n = sys3(NR_read, s.gate[0], &b, 1);
        while (n == -B_EINTR);
        a->stage = n == 1 ? 0 : 5; /* 5: pid 1 ended before boxinit was sealed; the box reports it */
    }
    sys1(NR_close, s.gate[0]);
    sys4(NR_rt_sigprocmask, B_SIG_SETMASK, &s.old_mask, 0, 8);
    return pid;
}
