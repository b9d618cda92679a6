/* pytest-boxlite's native pid 1 of a test's box: what guest/fresh.py's BareInit does, without a
 * copy of the warm interpreter.
 *
 * boxclone.c's pid 1 (which shares the warm interpreter's memory) forks the test process, then
 * executes this with the descriptor of this file: it forwards the signals in the mask to the test
 * process, reaps whatever else ends in the box, writes a root test's nested id maps when it asks,
 * and exits as the test process exits (128+N when signal N killed it).
 *
 * argv: boxinit TEST MASK GATE READY DONE UIDMAP GIDMAP
 *   TEST    the test process's pid (in this pid namespace)
 *   MASK    the signals to forward, a decimal bit mask (bit N-1: signal N); SIGCHLD is added
 *   GATE    a pipe's write end: two bytes once this process is sealed (the warm interpreter and the
 *           test process each wait for one), then closed
 *   READY   "-", or the nested mapper's end on which the test process says "u\n" (unshared)
 *   DONE    "-", or the end on which this process answers "m\n" (maps written)
 *   UIDMAP, GIDMAP  the nested user namespace's maps ("-": none)
 *
 * Freestanding (no C library): it runs in any box, and an exec of it costs little.  Every signal
 * is blocked when it starts (boxclone.c blocks them all before the clone), so none is lost or
 * handled before the mask below is in place. */
#include "sys.h"

void *memset(void *d, int c, unsigned long n)
{
    unsigned char *p = d;
    while (n--)
        *p++ = (unsigned char)c;
    return d;
}

void *memcpy(void *d, const void *s, unsigned long n)
{
    unsigned char *p = d;
    const unsigned char *q = s;
    while (n--)
        *p++ = *q++;
    return d;
}

__attribute__((noreturn)) static void quit(long code)
{
    for (;;)
        sys1(NR_exit_group, code);
}

static void write_map(long test, const char *which, const char *data, int *written)
{
    char path[64], num[21];
    char *p = path;
    const char *parts[4] = {"/proc/", b_utoa((unsigned long)test, num), "/", which};
    for (int i = 0; i < 4; i++)
        for (const char *q = parts[i]; *q && p < path + sizeof(path) - 1; q++)
            *p++ = *q;
    *p = 0;
    long fd = sys4(NR_openat, -100, path, B_O_WRONLY | B_O_CLOEXEC, 0);
    if (fd < 0)
        return;
    long len = (long)b_strlen(data);
    if (sys3(NR_write, fd, data, len) == len)
        (*written)++;
    sys1(NR_close, fd);
}

/* A root test's nested user namespace: its maps, once it says it has unshared (it has mounted the
 * box's /proc by then: the mount namespace is this process's too, and TEST is its pid there). */
static void serve_nested(long test, long ready, long done, const char *uid_map, const char *gid_map)
{
    char buf[2];
    if (sys3(NR_read, ready, buf, 2) == 2 && buf[0] == 'u' && buf[1] == '\n') {
        int written = 0;
        write_map(test, "uid_map", uid_map, &written);
        write_map(test, "gid_map", gid_map, &written);
        if (written == 2)
            sys3(NR_write, done, "m\n", 2);
    }
    sys1(NR_close, ready);
    sys1(NR_close, done);
}

__attribute__((noreturn, used)) void boxinit_main(long *sp)
{
    long argc = sp[0];
    char **argv = (char **)(sp + 1);
    if (argc != 8)
        quit(70);
    long test = b_atol(argv[1]), gate = b_atol(argv[3]);
    long ready = b_atol(argv[4]), done = b_atol(argv[5]);
    unsigned long mask = 0;
    for (const char *s = argv[2]; *s; s++) {
        if (*s < '0' || *s > '9')
            quit(70);
        mask = mask * 10 + (unsigned long)(*s - '0');
    }
    mask |= 1UL << (B_SIGCHLD - 1);
    if (test <= 0 || gate < 0)
        quit(70);
    /* Sealed first: nothing in the box may ptrace pid 1 or open its descriptors through /proc
     * (an exec makes a process dumpable again). */
    if (sys5(NR_prctl, B_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0)
        quit(70);
    if (sys5(NR_prctl, B_PR_SET_PDEATHSIG, B_SIGKILL, 0, 0, 0) != 0)
        quit(70);
    /* SIGCHLD at its default (an ignored one would reap children unseen); the rest as execve left them. */
    unsigned long act[4] = {0, 0, 0, 0};
    sys4(NR_rt_sigaction, B_SIGCHLD, act, 0, 8);
    sys3(NR_write, gate, "ss", 2);
    sys1(NR_close, gate);
    /* Forwarded signals and SIGCHLD stay blocked (taken by sigtimedwait); any other is unblocked:
     * pid 1 of a pid namespace without a handler for it ignores it. */
    if (sys4(NR_rt_sigprocmask, B_SIG_SETMASK, &mask, 0, 8) != 0)
        quit(70);
    if (ready >= 0 && done >= 0)
        serve_nested(test, ready, done, argv[6], argv[7]);
    for (;;) {
        for (;;) { /* what ended before, or since the last SIGCHLD */
            int status = 0;
            long pid = sys4(NR_wait4, -1, &status, B_WNOHANG, 0);
            if (pid == test) {
                int sig = status & 0x7f;
                quit(sig ? 128 + sig : (status >> 8) & 0xff);
            }
            if (pid == 0)
                break;
            if (pid == -B_EINTR)
                continue;
            if (pid < 0)
                quit(70); /* no child left, the test process unseen: cannot be */
        }
        long sig = sys4(NR_rt_sigtimedwait, &mask, 0, 0, 8);
        if (sig > 0 && sig != B_SIGCHLD)
            sys2(NR_kill, test, sig);
    }
}

#if defined(__x86_64__)
__asm__(".text\n.global _start\n_start:\n xor %rbp, %rbp\n mov %rsp, %rdi\n and $-16, %rsp\n call boxinit_main\n hlt\n");
#elif defined(__aarch64__)
__asm__(".text\n.global _start\n_start:\n mov x29, #0\n mov x30, #0\n mov x0, sp\n bl boxinit_main\n brk #0\n");
#endif
