/* icount-mark: executes the icount plugin's marker instruction (xchg %bx,%bx) once. */
int main(void)
{
    __asm__ volatile("xchg %%bx, %%bx" ::: "rbx");
    return 0;
}
